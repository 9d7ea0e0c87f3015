#!/usr/bin/env bash
# The whole GPU suite on ONE H200 (device kind nvidia-h200) in ONE device command (give it timeout_s=600):
#   bash scripts/gpu_1gpu.sh              # every step below: ~7 min estimated; step limits add up to 520 s
#   bash scripts/gpu_1gpu.sh mps2 run4    # only the named steps (single ts2 ts4 run4 mps2 mps4 soak bench)
# Multi-rank tests put every rank on the one GPU (tests/conftest.py `gpu_world`; docs/platform.md "Several ranks on
# one GPU"): time-sliced at W=2 and W=4, then under a private MPS daemon (one per world, stopped after it) at W=2 and
# W=4; tests that need one GPU per rank (an NCCL group) skip saying so. Logs and JSON go to $OUT (default ./gpu_out):
# one log per step with pytest's --durations list (re-measure these estimates from it), a verdict line per step in
# $OUT/summary.txt. Every step runs under a time limit with margin; a step past it is stopped by SIGTERM, which ends
# its ranks and its MPS daemon (tritonep.testing.interrupts).
#
# Step times, estimated (none of these steps has run yet) from DESIGN.md §1b's cross-rank flag round trip: 2.5 ms
# time-sliced at W=2, 4.5 ms at W=4, 204 / 86 us under MPS. One dispatch + combine waits on peers ~4 times; the suite
# makes ~520 such calls per world size (graph test 200, protocol scripts 140, decode 96, cases, gradients, MoE layer,
# virtual experts, transport, staging) -> ~2100 waits: ~5 s time-sliced at W=2, ~10 s at W=4, < 1 s under MPS. Run
# side by side (group A: ~11 CUDA contexts share the GPU) a wait costs up to ~4x more: <= 40 s. The rest is start-up
# (pytest ~10 s, a world ~15 s, once per world size: worlds stay up between tests), Triton compiles on a cold cache
# (~3 s per buffer configuration and rank process, ~25 configurations; W and the rank are compile-time constants,
# so every world size compiles its own), the host references in the pytest process (~30 s at W=2, ~60 s at W=4),
# torch.compile in the MoE layer test (~40 s) and, for `single`, the one-process GPU tests (85 s measured on
# 2026-12-01). Estimates: single ~90 s, ts2 ~200 s, ts4 ~230 s, run4 ~60 s (group A, side by side: ~230 s, limit
# 270), mps2 ~90 s (kernels cached by ts2), mps4 ~100 s. The 1000-replay soaks (soak marker) are a step of their own,
# `soak` (~60 s under MPS; time-sliced they would wait ~16000 x 2.5 ms = 40 s more each): run it in a second command.
source "$(dirname "$0")/gpu_step.sh"
PYTEST=(python -m pytest -q -ra -p no:cacheprovider --durations=25 tests)  # pytest-timeout: SIGALRM by default
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(single ts2 ts4 run4 mps2 mps4)
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

stop_leftover_mps() {  # a world killed outright could leave its private daemon: quit it by its own pipe folder
    local d
    for d in "${TMPDIR:-/tmp}"/tritonep_world_*/mps_pipe; do
        [ -e "$d" ] || continue
        echo "leftover MPS daemon at $d: quitting it"
        echo quit | CUDA_MPS_PIPE_DIRECTORY="$d" CUDA_MPS_LOG_DIRECTORY="${d%/mps_pipe}/mps_log" timeout 20 \
            nvidia-cuda-mps-control || true
        rm -rf "${d%/mps_pipe}"  # no world runs between steps: this one's owner was killed
    done
}

nvidia-smi -L
nvidia-smi --query-gpu=compute_mode --format=csv,noheader
command -v nvidia-cuda-mps-control || echo "nvidia-cuda-mps-control not found: the MPS steps will fail at start"

# group A, side by side (no MPS daemon runs meanwhile): one-process tests, time-sliced worlds of 2 and 4, the CLI
want single && OMP_NUM_THREADS=4 step single 270 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 200 &
want ts2 && OMP_NUM_THREADS=4 step ts2 270 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    --gpu-world-sizes 2 \
    --timeout 200 --maxfail 8 &
want ts4 && OMP_NUM_THREADS=4 step ts4 270 "${PYTEST[@]}" -m "gpu and anyworld and not soak" --gpu-world-sizes 4 \
    --timeout 200 --maxfail 8 &
want run4 && OMP_NUM_THREADS=4 step run4 270 python -m tritonep.cli.main run --world-size 4 --layers 2 3 \
    --json "$OUT/run_w4.json" &
wait
stop_leftover_mps

# group B, one after the other (one MPS daemon at a time; their ranks' SM shares must not add up past the chip)
want mps2 && step mps2 130 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" --gpu-world-sizes 2 \
    --gpu-mps on \
    --timeout 100 --maxfail 4
stop_leftover_mps
want mps4 && step mps4 120 "${PYTEST[@]}" -m "gpu and anyworld and not soak" --gpu-world-sizes 4 --gpu-mps on \
    --timeout 100 --maxfail 4
stop_leftover_mps

# not in the default run: the 1000-replay CUDA-graph soaks (world of 2, under MPS) and the world-1 benchmarks
want soak && step soak 240 "${PYTEST[@]}" -m "gpu and soak" --gpu-world-sizes 2 --gpu-mps on --timeout 220
stop_leftover_mps
if want bench; then  # world-1 rows (kernels without NVLink), planner sweep, eager profile: ~6 min
    step planner 80 python benchmarks/planner_bench.py --modes reference minimal --num-programs 0 32 128 \
        --blocks 0 32 128 --json "$OUT/planner.json"
    step eager 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 4096 --json "$OUT/eager.json"
    step eager_decode 60 env TRITONEP_GEOMETRY=bt=1,dec=128 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
        --tokens 128 --json "$OUT/eager_decode.json"
    step ep_w1 170 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles deepseek-v3 decode decode-1launch \
        --iters 20 --json "$OUT/ep_w1.json" ${EP_VARIANTS:-}
fi
cat "$OUT/summary.txt"
