#!/usr/bin/env bash
# The whole GPU suite on ONE H200 (device kind nvidia-h200), in four device commands of at most 600 s each (give
# each timeout_s=600); the four take a whole 30-minute device session, so pick the calls a change needs:
#   bash scripts/gpu_1gpu.sh call1   # single + run4 + ts2 side by side      ~420 s cold (limits 260/120/500)
#   bash scripts/gpu_1gpu.sh call2   # mps2, then soak (W=2 under MPS)       ~360 s + soak (limits 390 + 150)
#   bash scripts/gpu_1gpu.sh call3   # mps4 (W=4 under MPS)                  ~400 s cold (limit 480)
#   bash scripts/gpu_1gpu.sh call4   # ts4 (W=4 time-sliced)                 ~450 s cold (limit 520)
#   bash scripts/gpu_1gpu.sh mps2 run4    # only the named steps (single ts2 ts4 run4 mps2 mps4 soak bench)
# call2 and call3 run every multi-rank test at W=2 and W=4 with the ranks at once (MPS): the first to run; call1
# the one-process tests, the CLI at W=4 and the W=2 tests time-sliced; call4 the W=4 tests time-sliced.
# Multi-rank tests put every rank on the one GPU (tests/conftest.py `gpu_world`; docs/platform.md "Several ranks on
# one GPU"); tests that need one GPU per rank (an NCCL group) skip saying so. Logs and JSON go to $OUT (default
# ./gpu_out): one log per step, pytest -v (every test's name is printed when it starts, so a step killed at its limit
# still says which test was running) with skip reasons (-ra) and the --durations list; a verdict line per step in
# $OUT/summary.txt. Past its limit a step gets SIGINT (pytest prints its failures and durations so far), SIGKILL 15 s
# later; that ends its ranks and its MPS daemon (tritonep.testing.interrupts).
#
# Step times, measured on 2026-12-01 (session 4, one H200, cold Triton caches: every world size compiles its own
# kernels, W and the rank being compile-time constants; benchmarks/results/device_session4_2026-12-01.md and the
# gpu_tests_*_h200x1_session4_2026-12-01.log files):
#   single  41 tests, 200 s side by side with ts2, ts4, run4 (38 passed, the one failure a test bug fixed since)
#   run4    tritonep run --world-size 4 --layers 2 3, time-sliced: 58 s side by side (48.5 s of it the run's wall)
#   ts2     37 of 43 tests in 271 s side by side with single, ts4, run4 (stopped at the then limit of 270 s); the
#           6 left are the slowest W=2 tests under MPS (MoE layer + compile 23 s, virtual experts 17 s, own-rank
#           staging 18 s): ~400 s for all 43
#   ts4     18 of 28 tests in 271 s side by side (stopped at its limit); ~450 s alone is an extrapolation
#   mps2    cold: 30 tests in 202 s, then the other 14 (+2 repeated) in 175 s, two commands: ~360 s for the 44 in
#           one run; warm (kernels cached by ts2 in the same command): 39 tests in 130 s
#   mps4    cold: 25 of 28 tests in 317 s (stopped at its limit of 320 s; the 3 left not measured): ~400 s
#   soak    not measured yet (two 1000-replay CUDA-graph soaks at W=2 under MPS; kernels cached by mps2)
# The slowest single tests: test_ep_cases_match_reference 40 s (W=2 MPS) / 53 s (W=4 MPS), the host-protocol script
# "big" 13-34 s, the decode one-launch test 22-27 s on its first (compiling) case, test_gpu_plan_matches_torch 12-24 s.
# A warm machine (same session, caches kept) runs about twice as fast; these limits assume cold caches.
steps=()
for a in "$@"; do
    case "$a" in
        call1) steps+=(single run4 ts2) ;;
        call2) steps+=(mps2 soak) ;;
        call3) steps+=(mps4) ;;
        call4) steps+=(ts4) ;;
        single|ts2|ts4|run4|mps2|mps4|soak|bench) steps+=("$a") ;;
        *) echo "unknown step $a (call1 call2 call3 call4; steps single ts2 ts4 run4 mps2 mps4 soak bench)"; exit 2 ;;
    esac
done
if [ ${#steps[@]} -eq 0 ]; then
    sed -n '2,10p' "$0"  # the usage lines above: the suite no longer fits one 600 s command
    exit 2
fi
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
source "$(dirname "$0")/gpu_step.sh"
PYTEST=(python -m pytest -v -ra -p no:cacheprovider --durations=40 tests)  # pytest-timeout: SIGALRM by default

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

# group A, side by side (no MPS daemon runs meanwhile): one-process tests, the CLI, time-sliced worlds of 2 and 4
# (ts2 and ts4 together would need ~500 s each: name them in one command only with nothing after them)
want single && OMP_NUM_THREADS=4 step single 260 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 200 &
want run4 && OMP_NUM_THREADS=4 step run4 120 python -m tritonep.cli.main run --world-size 4 --layers 2 3 \
    --json "$OUT/run_w4.json" &
want ts2 && OMP_NUM_THREADS=4 step ts2 500 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    --gpu-world-sizes 2 --timeout 200 --maxfail 8 &
want ts4 && OMP_NUM_THREADS=4 step ts4 520 "${PYTEST[@]}" -m "gpu and anyworld and not soak" --gpu-world-sizes 4 \
    --timeout 200 --maxfail 8 &
wait
stop_leftover_mps

# group B, one after the other (one MPS daemon at a time; their ranks' SM shares must not add up past the chip)
want mps2 && step mps2 390 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" --gpu-world-sizes 2 \
    --gpu-mps on --timeout 120 --maxfail 4
stop_leftover_mps
want soak && step soak 150 "${PYTEST[@]}" -m "gpu and soak" --gpu-world-sizes 2 --gpu-mps on --timeout 140
stop_leftover_mps
want mps4 && step mps4 480 "${PYTEST[@]}" -m "gpu and anyworld and not soak" --gpu-world-sizes 4 --gpu-mps on \
    --timeout 120 --maxfail 4
stop_leftover_mps

# not in any call: the world-1 benchmarks (a command of their own)
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
