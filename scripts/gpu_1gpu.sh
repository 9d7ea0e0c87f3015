#!/usr/bin/env bash
# Everything that runs on ONE H200 (device kind nvidia-h200), in one device command (~6-8 min):
#   bash scripts/gpu_1gpu.sh
# GPU tests that need one GPU (multi-GPU tests skip), the one-launch planner benchmark with its chunk / tile sweep
# (W = 2..8 simulated on one device, self-checked), the eager profile (default and one-launch decode geometry), and
# world-1 EP rows (kernels without NVLink: the HBM side of dispatch / combine), every row checked. Logs and JSON go to $OUT (default ./gpu_out); every step
# has a measured limit with margin and prints its verdict.
source "$(dirname "$0")/gpu_step.sh"
nvidia-smi -L
step gpu_tests_1gpu 180 python -m pytest -q -m gpu tests -p no:cacheprovider --timeout 200 -ra
step planner 80 python benchmarks/planner_bench.py --modes reference minimal --num-programs 0 32 128 \
    --blocks 0 32 128 --json "$OUT/planner.json"
step eager 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 4096 --json "$OUT/eager.json"
step eager_decode 60 env TRITONEP_GEOMETRY=bt=1,dec=128 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
    --tokens 128 --json "$OUT/eager_decode.json"
step ep_w1 170 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles deepseek-v3 decode decode-1launch \
    --iters 20 --json "$OUT/ep_w1.json" ${EP_VARIANTS:-}
cat "$OUT/summary.txt"
