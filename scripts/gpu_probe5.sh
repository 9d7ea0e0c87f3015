#!/usr/bin/env bash
# Issue 24, session 5 (2026-12-02), first device call on ONE H200 (world 1): what the host path costs today with
# the one-launch decode geometry (TRITONEP_GEOMETRY=dec=G) at 128 tokens, the two-kernel dispatch at 4096 (the send
# overlaps the host read), the nccl backend through BoundKernel, and `tritonep run` warm (--steps 3, last step kept).
#   bash scripts/gpu_probe5.sh [steps...]     (default: every step; one device command, timeout_s=600)
source "$(dirname "$0")/gpu_step.sh"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(dec128 two4096 nccl run hostdec dec32 nccltest)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
nvidia-smi -L
want dec128 && TRITONEP_GEOMETRY=dec=128 step dec128 100 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
    --tokens 128 --json "$OUT/eager_dec128.json"
want two4096 && TRITONEP_GEOMETRY=fs=0,fe=0 step two4096 100 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
    --tokens 4096 --json "$OUT/eager_two4096.json"
want nccl && step nccl 120 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --backend nccl --tokens 128 4096 \
    --json "$OUT/eager_nccl.json"
want run && step run 150 python -m tritonep.cli.main run --steps 3 --json "$OUT/run_w1.json"
want hostdec && TRITONEP_GEOMETRY=dec=128 STEP_TEE=0 step hostdec 80 torchrun --nproc-per-node 1 \
    benchmarks/host_profile.py --tokens 128 --calls 200 --top 25
want dec32 && TRITONEP_GEOMETRY=dec=32 step dec32 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
    --tokens 128 --json "$OUT/eager_dec32.json"
want nccltest && step nccltest 60 python -m pytest -q -m gpu tests/ep/nccl/test_bound_launches.py -p no:cacheprovider
cat "$OUT/summary.txt"
