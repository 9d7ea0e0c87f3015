#!/usr/bin/env bash
# Geometry sweep on ONE H200 (world 1: the HBM side of the kernels, no NVLink), one device command:
#   EP_VARIANTS="deepseek-v3:24:bf16:cbt=8,cwarps=16 ..." bash scripts/gpu_sweep.sh
# Runs the one-GPU GPU tests of the EP kernels (exactness with the current table), then ep_bench at world 1 for the
# DeepSeek-V3 shape (bf16, 132 and 24 SMs) with the variants; logs and JSON under $OUT. Each step has a limit.
source "$(dirname "$0")/gpu_step.sh"
nvidia-smi -L
[ -n "${GPU_TESTS:-}" ] && step gpu_tests ${GPU_TESTS_LIMIT:-200} python -m pytest -q -m gpu $GPU_TESTS -p no:cacheprovider -x -ra
TAIL=${SWEEP_TAIL:-40} step sweep ${SWEEP_LIMIT:-360} torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles deepseek-v3 \
    --num-sms ${SWEEP_SMS:-0 24} --wires ${SWEEP_WIRES:-bf16} --iters 20 --json "$OUT/sweep.json" --variants ${EP_VARIANTS:-}
cat "$OUT/summary.txt"
