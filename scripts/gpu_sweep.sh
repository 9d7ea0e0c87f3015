#!/usr/bin/env bash
# Geometry sweep on ONE H200 (world 1: the HBM side of the kernels, no NVLink), one device command:
#   EP_VARIANTS="deepseek-v3:24:bf16:cbt=8,cwarps=16 ..." bash scripts/gpu_sweep.sh
# Runs the one-GPU GPU tests of the EP kernels (exactness with the current table), then ep_bench at world 1 for the
# DeepSeek-V3 shape (bf16, 132 and 24 SMs) with the variants; logs and JSON under $OUT. Each step has a limit.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
step() {  # step NAME LIMIT_S CMD...: run with a limit, log to $OUT/NAME.log, print the verdict
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | grep -v -i warning > "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    tail -${TAIL:-6} "$OUT/$name.log"
    echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}
nvidia-smi -L
[ -n "${GPU_TESTS:-}" ] && step gpu_tests ${GPU_TESTS_LIMIT:-200} python -m pytest -q -m gpu $GPU_TESTS -p no:cacheprovider -x -ra
TAIL=${SWEEP_TAIL:-40} step sweep ${SWEEP_LIMIT:-360} torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles deepseek-v3 \
    --num-sms ${SWEEP_SMS:-0 24} --wires ${SWEEP_WIRES:-bf16} --iters 20 --json "$OUT/sweep.json" --variants ${EP_VARIANTS:-}
cat "$OUT/summary.txt"
