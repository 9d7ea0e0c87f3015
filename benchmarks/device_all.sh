#!/usr/bin/env bash
# Device calls of a session, in two parts that each fit one 10-minute call (repo root on the GPU machine):
#   bash benchmarks/device_all.sh tests   # GPU tests (default and fused/small-tile geometry), planner timing,
#                                         # MoE layer none vs virtual experts on skewed routing
#   bash benchmarks/device_all.sh bench   # EP benchmark + geometry sweep, MoE layer fwd+bwd vs torch+NCCL (profiled)
#   bash benchmarks/device_all.sh moe     # only the MoE layer benchmark
# Results land under $OUT (logs + JSON); index each JSON with `python scripts/results_index.py add FILE --machine
# h200x2` (benchmarks/README.md "Results and their history") and commit it with this command.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
LOG=$OUT/$1.log
# geometry sweep: PROFILE:SMS:WIRES:GEOMETRY (TRITONEP_GEOMETRY syntax; fs/fe > 0 = fused one-launch dispatch)
VARIANTS=(
  "decode:0:bf16:bt=2,grid=128" "decode:0:bf16:bt=1,grid=128" "decode:0:bf16:bt=2,grid=128,fs=32,fe=64"
  "decode:0:bf16:bt=1,grid=128,fs=64,fe=64" "decode:0:bf16+fp8:bt=4,grid=64,fs=16,fe=64"
  "deepseek-v3:0:bf16+fp8+mxfp4:fs=64,fe=64" "deepseek-v3:0:bf16:fs=40,fe=88" "deepseek-v3:0:bf16:fs=88,fe=40"
  "deepseek-v3:0:bf16:bt=8,fs=64,fe=64"
  "deepseek-v3:24:bf16:fs=12,fe=12" "deepseek-v3:24:bf16:bt=32,warps=16" "deepseek-v3:24:bf16:bt=32,warps=16,fs=12,fe=12"
)
step() { local t=$1; shift; echo "=== [$(date +%T)] $* (limit ${t}s)" | tee -a $LOG; timeout $t "$@" 2>&1 | grep -v -i warning | tee -a $LOG | tail -${TAIL:-25}; echo "=== rc=${PIPESTATUS[0]}" | tee -a $LOG; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a $LOG
case $1 in
tests)
  step 80 python -m pytest -q -m gpu tests/ep/test_gpu.py -p no:cacheprovider --durations=3
  step 80 env TRITONEP_GEOMETRY=bt=2,fs=64,fe=64,fc=1 python -m pytest -q -m gpu tests/ep/test_gpu.py -k "cases or graph" -p no:cacheprovider
  step 80 python -m pytest -q -m gpu tests/wire/test_quantizers.py tests/balance/test_planner.py tests/balance/test_planner_one_launch.py "tests/ep/nccl/test_wires.py::test_gpu_nccl_wires_match_triton_and_twins[fp8-fp8]" -p no:cacheprovider
  step 100 python -m pytest -q -s -m gpu tests/ep/test_soak.py -p no:cacheprovider
  step 60 python benchmarks/planner_bench.py --modes reference minimal --json $OUT/planner.json
  step 150 python benchmarks/moe_bench.py --skew --steps 5 --json $OUT/moe_skew.json ;;
moe)
  step 110 python benchmarks/moe_bench.py --steps 5 --profile --json $OUT/moe.json ;;
bench)
  # main rows (table geometry, both profiles, full and 24 SMs), then the geometry sweep (see benchmarks/README.md)
  step 320 env TRITONEP_TIMEOUT_S=5 torchrun --nproc-per-node 2 benchmarks/ep_bench.py --num-sms 0 24 --iters 20 \
    --json $OUT/ep_bench.json --overlap 24 0 --variants "${VARIANTS[@]}"
  step 110 python benchmarks/moe_bench.py --steps 5 --profile --json $OUT/moe.json ;;
esac
