#!/usr/bin/env bash
# Issue 24, session 5, second device call (ONE H200, world 1): per-launch host cost split (benchmarks/launch_probe.py)
# with the default and the decode geometry, then ep_bench bf16 (nccl backend vs the 30-line NCCL pipeline rows).
source "$(dirname "$0")/gpu_step.sh"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(probe probedec epb)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
want probe && STEP_TEE=1 step probe 90 torchrun --nproc-per-node 1 benchmarks/launch_probe.py --tokens 128 \
    --json "$OUT/launch_probe.json"
want probedec && STEP_TEE=1 step probedec 90 torchrun --nproc-per-node 1 benchmarks/launch_probe.py --tokens 128 \
    --geometry dec=128 --json "$OUT/launch_probe_dec128.json"
want epb && step epb 200 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --wires bf16 --json "$OUT/ep_bench_bf16.json"
cat "$OUT/summary.txt"
cd "$OUT" && tar czf logs.tgz *.log *.json summary.txt && rm -f *.log *.json summary.txt
