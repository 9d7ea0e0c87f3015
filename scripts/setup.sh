#!/usr/bin/env bash
# Set up a fresh CPU machine: .venv with the pinned CPU stack (torch 2.13.0 CPU wheel, triton 3.6.0, numpy<2.3,
# transformers 5.24.0 for the equality tests), tritonep in editable mode, torchtitan 0.3.0 and megatron-core 0.16.1 for the integration
# tests. One progress line per step. On a GPU machine use the machine's own torch / triton instead (README, "Install").
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
say() { echo "setup [$1/5, $((SECONDS - t0)) s]: $2"; }
say 1 "python virtual environment .venv"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
say 2 "torch 2.13.0 (CPU), triton 3.6.0, numpy<2.3, pytest, rich, matplotlib, transformers 5.24.0 (the longest step)"
# transformers: the reference MoE blocks of tests/moe/test_hf_equality.py (pinned; resolves together with torchtitan 0.3.0)
python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.3" pytest pytest-timeout rich matplotlib \
  "transformers==5.24.0"
say 3 "tritonep (editable install of this checkout)"
python -m pip install -q --no-deps -e .
say 4 "torchtitan 0.3.0 and its dependencies (the optional integration, tested in CI)"
python -m pip install -q "numpy<2.3" "torchtitan==0.3.0"
say 5 "megatron-core 0.16.1 (the DeepEP-compatible Buffer's framework test, tested in CI)"
# megatron-core's own DeepEP path on tritonep's DeepEP-compatible Buffer (tests/compat/test_megatron.py): the newest
# release that installs on Python 3.11 (its wheel is cp311); pure Python apart from its dataset index builder, no CUDA
python -m pip install -q "numpy<2.3" "megatron-core==0.16.1"
echo "setup done in $((SECONDS - t0)) s: .venv/bin/tritonep run (the main job) or bash scripts/test.sh (the tests)"
