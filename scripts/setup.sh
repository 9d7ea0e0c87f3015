#!/usr/bin/env bash
# Set up a fresh machine: .venv with the pinned CPU stack (torch 2.13.0 CPU wheel, triton 3.6.0, numpy<2.3,
# transformers 5.24.0 for the equality tests) and
# tritonep installed in editable mode. On the GPU machine use the machine's own torch/triton instead (README).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# transformers: the reference MoE blocks of tests/moe/test_hf_equality.py (pinned; resolves together with torchtitan 0.3.0)
python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3" pytest pytest-timeout rich tqdm matplotlib \
  "transformers==5.24.0"
python -m pip install -q --no-deps -e .
# optional integration tested in CI (tests/integrations/test_torchtitan.py): torchtitan and its dependencies (~60 packages)
python -m pip install -q "numpy<2.3" "torchtitan==0.3.0"
# megatron-core's own DeepEP path on tritonep's DeepEP-compatible Buffer (tests/compat/test_megatron.py): the newest
# release that installs on Python 3.11 (its wheel is cp311); pure Python apart from its dataset index builder, no CUDA
python -m pip install -q "numpy<2.3" "megatron-core==0.16.1"
