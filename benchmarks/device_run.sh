#!/usr/bin/env bash
# One device call: GPU tests + EP benchmark. Usage on the device machine (repo root): bash benchmarks/device_run.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
timeout ${TEST_TIMEOUT:-300} python -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -40
timeout ${BENCH_TIMEOUT:-240} torchrun --nproc-per-node 2 benchmarks/ep_bench.py ${BENCH_ARGS:-} --json $OUT/ep_bench.json 2>&1 | tee $OUT/ep_bench.log | grep -v Warning | tail -40
