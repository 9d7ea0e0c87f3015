#!/usr/bin/env bash
# Issue 24 on ONE H200, after `bash scripts/gpu_wheels.sh` here and with `carry: [".whl"]`. Session 4 (2026-12-01)
# ran every step but titan (torchtitan 0.3.0's deepseek_v3 package did not import on the device's torch 2.11; fixed:
# benchmarks/titan_bench.py docstring). Next, one device command (timeout_s=600; step limits 150 + 420 s):
#   bash scripts/gpu_host_path.sh titan titanc
# (no argument: every step, longer than one command's 10 minutes; the old split: `probe eager nccl hostpy`, then
# `peer layer`)
# World 1 (kernels without NVLink). Logs + JSON under $OUT; every row of every benchmark checks its output.
#   probe : host cost per launch path (JIT / compiled runner / C launcher with tensors / with int pointers / graph
#           replay) and per torch op: the numbers that choose the launch path (keep the loser's in the note)
#   eager : graph-replay vs eager dispatch / combine at 128 and 4096 tokens (DeepSeek-V3 shape), host us per call and
#           per launch (targets: 128 tokens eager <= graph + 25 us dispatch, + 15 us combine; 4096 <= 1.1x graph)
#   nccl  : the same for backend="nccl" vs the 30-line NCCL pipeline (ep_bench eager rows)
#   hostpy: cProfile of 200 eager pairs at 128 tokens, forward and with backward
#   peer  : tritonep vs torchtitan MinimalAsyncEP, eager and graph, 128 / 4096 tokens (needs .whl)
#   titan : torchtitan's MoE layer fwd+bwd with our dispatcher vs MinimalAsyncEP vs AllToAll, eager, 128 / 4096
#           tokens, DeepSeek-V3 671B layer (needs .whl; the issue's must-show rows)
#   titanc: the same, eager again and torch.compile(fullgraph=True) per dispatcher (6 cold compiles; the JSON is
#           rewritten after each token count, so a stop at the limit keeps the 128-token rows)
#   layer : the MoE layer's fwd+bwd step eager vs one captured CUDA graph, sync-free mode (bit-equal; <= 1.2x)
source "$(dirname "$0")/gpu_step.sh"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(probe eager nccl hostpy peer titan titanc layer)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
use_wheels
nvidia-smi -L
want probe && step probe 120 python benchmarks/host_cost.py --json "$OUT/host_cost.json"
want eager && step eager 150 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 4096 \
    --json "$OUT/eager_triton.json"
want nccl && step nccl 120 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --backend nccl --tokens 128 4096 \
    --json "$OUT/eager_nccl.json"
want hostpy && STEP_TEE=1 step hostpy 90 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 128 \
    --calls 200 --top 20
want peer && step peer 150 torchrun --nproc-per-node 1 benchmarks/peer_bench.py --json "$OUT/peer_bench.json"
want titan && step titan 150 torchrun --nproc-per-node 1 benchmarks/titan_bench.py --no-compile \
    --json "$OUT/titan_bench.json"
want titanc && step titanc 420 torchrun --nproc-per-node 1 benchmarks/titan_bench.py \
    --json "$OUT/titan_bench_compiled.json"
want layer && step layer 150 torchrun --nproc-per-node 1 benchmarks/moe_graph_bench.py --tokens 128 4096 \
    --json "$OUT/moe_graph.json"
cat "$OUT/summary.txt"
