#!/usr/bin/env bash
# Issue 24, first device call (one H200, ~4 min): host cost of launch paths and torch ops, the eager profile of the
# tree as it is (before), cProfile of eager calls. Logs + JSON under $OUT.
source "$(dirname "$0")/gpu_step.sh"
nvidia-smi -L
step host_cost 150 python benchmarks/host_cost.py --json "$OUT/host_cost.json"
step eager_before 150 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 4096 --json "$OUT/eager_before.json"
step eager_nccl_before 120 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --backend nccl --tokens 128 4096 --json "$OUT/eager_nccl_before.json"
STEP_TEE=1 step cprofile_128 90 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 128 --calls 200 --top 25
STEP_TEE=1 step cprofile_128_bwd 90 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 128 --calls 100 --backward --top 25
cat "$OUT/summary.txt"
