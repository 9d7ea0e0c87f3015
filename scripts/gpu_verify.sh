#!/usr/bin/env bash
# GPU verification on the device machine (2 x H200), in stages so each fits one 10-minute device command:
#   bash scripts/gpu_verify.sh tests   # every GPU test (pytest -m gpu), incl. the 1000-replay graph soak
#   bash scripts/gpu_verify.sh layer   # moe_bench --skew (none vs virtual, fwd+bwd) and tritonep run on both GPUs
#   bash scripts/gpu_verify.sh bench   # ep_bench (graph + eager rows, nccl backend vs pipeline) and the eager profile
#   bash scripts/gpu_verify.sh short   # layer + bench trimmed to fit one command
# Logs and JSON go to $OUT (default ./gpu_out); every step has a measured time limit with margin and prints progress.
source "$(dirname "$0")/gpu_step.sh"
STEP_TEE=${STEP_TEE:-1}
stage=${1:-tests}
case "$stage" in
tests)
    nvidia-smi -L
    step gpu_tests 560 python -m pytest -q -m gpu tests -p no:cacheprovider --timeout 300 --durations=30 -ra
    ;;
layer)
    step moe_skew 280 python benchmarks/moe_bench.py --skew --steps 3 --json "$OUT/moe_skew.json"
    step run_2gpu 250 python -m tritonep.cli.main run --layers 2 3 4 --json "$OUT/run_2gpu.json"
    ;;
bench)
    step ep_bench 380 torchrun --nproc-per-node 2 benchmarks/ep_bench.py --profiles deepseek-v3 deepseek-v3-1k decode \
        --json "$OUT/ep_bench.json"
    step eager_profile 150 torchrun --nproc-per-node 2 benchmarks/eager_profile.py --tokens 128 4096 \
        --json "$OUT/eager_profile.json"
    ;;
short)  # layer + bench in one 10-minute command (device time is scarce): fewer layers, no eager profile
    step moe_skew 200 python benchmarks/moe_bench.py --skew --steps 3 --json "$OUT/moe_skew.json"
    step run_2gpu 110 python -m tritonep.cli.main run --layers 2 3 --json "$OUT/run_2gpu.json"
    step torchrun_example 90 torchrun --nproc-per-node 2 examples/torchrun_moe.py
    step ep_bench 260 torchrun --nproc-per-node 2 benchmarks/ep_bench.py --profiles deepseek-v3 deepseek-v3-1k decode \
        --json "$OUT/ep_bench.json"
    ;;
*) echo "unknown stage $stage (tests | layer | bench | short)"; exit 2 ;;
esac
cat "$OUT/summary.txt"
