#!/usr/bin/env bash
# Issue 24, session 6 (2026-12-02): verification on ONE H200, one device command per letter (timeout_s=600 each):
#   bash scripts/gpu_verify6.sh V     # single (46 world-1 GPU tests) + mps2 (W=2 under MPS: ep core, host protocol,
#                                     #   decode; the decode default routes small batches through one launch)  ~520 s
#   bash scripts/gpu_verify6.sh M     # measure: eager (128/4096) + eager_dec0 + peer + epb + layer + run        ~500 s
#   bash scripts/gpu_verify6.sh H     # the host-path change: launch tests (world 1 + W=2 MPS), eager new vs the
#                                     #   tree of 0d6c281 (carry .ab: `git archive 0d6c281 tritonep | tar -x -C
#                                     #   .ab/old`), probe, epb                                                 ~300 s
#   bash scripts/gpu_verify6.sh F     # final: world-1 ep + moe GPU tests, W=2 MPS (ep core, host protocol,
#                                     #   decode bf16), eager, probe, peer, layer                               ~500 s
#   bash scripts/gpu_verify6.sh N     # first call of session 7: world-1 ep + moe GPU tests (never run on the
#                                     #   session-6 tree), W=2 MPS (incl. gradients: the one-launch decode dispatch
#                                     #   backward), eager (its 128-token dispatch_bwd row), peer             ~470 s
#   bash scripts/gpu_verify6.sh Z     # session 7's last: eager (the world-1 two-kernel default) and the fused
#                                     #   dispatch in the same call, peer, `tritonep run`, the world-1 GPU suite ~520 s
#   bash scripts/gpu_verify6.sh L     # session 7's last call: world-1 ep + moe GPU tests, W=2 MPS core, eager,
#                                     #   peer, `tritonep run` on the final tree                            ~420 s
#   bash scripts/gpu_verify6.sh P     # session 7: host cProfile at 4096, eager at 4096 on the two-kernel
#                                     #   (unfused) path                                                    ~80 s
# or name steps (also session 5's: hostpy tests1 mps2dec; scripts/gpu_verify5.sh A / B name them). Carry [".whl"] (torchtitan 0.3.0 for the peer/titan tests). Logs and JSON under $OUT, packed into
# $OUT/logs.tgz (the device returns few files).
source "$(dirname "$0")/gpu_step.sh"
steps=()
for a in "$@"; do
    case $a in
        V) steps+=(single mps2) ;;
        M) steps+=(eager eager_dec0 peer epb layer run) ;;
        H) steps+=(tests_host eager eager_old probe epb) ;;
        F) steps+=(tests_ep tests_w2 eager probe peer layer) ;;
        N) steps+=(tests_ep tests_w2 eager peer) ;;  # next session's first call: what session 6 could not run
        P) steps+=(hostpy4k eager_fs0) ;;
        Z) steps+=(eager eager_fused peer run single) ;;  # session 7: world 1 two kernels vs fused, same call
        L) steps+=(tests_ep tests_w2 eager peer run) ;;  # session 7's last: the handle layout (rw first), geometry
        *) steps+=("$a") ;;
    esac
done
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
use_wheels
PYT=(python -m pytest -v -ra -p no:cacheprovider --durations=30)  # + the paths to run
PYTEST=("${PYT[@]}" tests)  # the whole suite (a step that names files uses PYT: session 6's tests_host / tests_ep
                            # named them after PYTEST's own `tests` and ran the whole suite from tests/balance)
want single && OMP_NUM_THREADS=4 step single 290 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 200
want mps2 && step mps2 210 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    -k "test_gpu.py or host_protocol or decode_gpu" --gpu-world-sizes 2 --gpu-mps on --timeout 120 --maxfail 6
want mps2rest && step mps2rest 265 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    -k "not (test_gpu.py or host_protocol or decode_gpu)" --gpu-world-sizes 2 --gpu-mps on --timeout 120 --maxfail 6
want tests_host && OMP_NUM_THREADS=4 step tests_host 110 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 100 tests/ep/triton/test_bound_direct.py tests/ep/test_combine_backward_rows.py \
    tests/ep/triton/test_fast_launch.py tests/moe/test_layer.py tests/moe/test_ids_full_width.py
want tests_host && step tests_host_w2 150 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    -k "test_gpu.py or (decode_gpu and bf16)" --gpu-world-sizes 2 --gpu-mps on --timeout 100 --maxfail 3
want tests_ep && OMP_NUM_THREADS=4 step tests_ep 150 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 100 tests/ep tests/moe/test_layer.py tests/moe/test_sync_free.py
want tests_w2 && step tests_w2 230 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    -k "test_gpu.py or host_protocol or (decode_gpu and bf16)" --gpu-world-sizes 2 --gpu-mps on --timeout 120 --maxfail 3
want eager_old && PYTHONPATH=.ab/old step eager_old 70 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
    --tokens 128 4096 --json "$OUT/eager_triton_old.json"
want eager && step eager 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 1024 4096 \
    --json "$OUT/eager_triton.json"
want eager_fused && TRITONEP_GEOMETRY=fs=40,fe=88 step eager_fused 60 torchrun --nproc-per-node 1 \
    benchmarks/eager_profile.py --tokens 1024 4096 --json "$OUT/eager_triton_fused.json"
want eager_dec0 && TRITONEP_GEOMETRY=dec=0 step eager_dec0 60 torchrun --nproc-per-node 1 \
    benchmarks/eager_profile.py --tokens 128 --json "$OUT/eager_triton_dec0.json"
want probe && step probe 50 torchrun --nproc-per-node 1 benchmarks/launch_probe.py --tokens 128 \
    --json "$OUT/launch_probe.json"
want hostpy && step hostpy 60 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 128 --calls 200 --top 25
want tests1 && OMP_NUM_THREADS=4 step tests1 150 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 120 tests/ep/test_combine_backward_rows.py tests/ep/triton/test_decode_gpu.py \
    tests/ep/nccl/test_bound_launches.py tests/ep/nccl/test_pinned_plan_gpu.py tests/ep/triton/test_own_rank_staging.py \
    tests/ep/triton/test_bound_direct.py tests/moe/test_sync_free.py
want mps2dec && step mps2dec 150 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" -k "decode or sync_free" \
    --gpu-world-sizes 2 --gpu-mps on --timeout 120 --maxfail 4
want hostpy4k && step hostpy4k 90 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 4096 --calls 100 \
    --top 30
want eager_fs0 && TRITONEP_GEOMETRY=fs=0,fe=0 step eager_fs0 60 torchrun --nproc-per-node 1 \
    benchmarks/eager_profile.py --tokens 4096 --json "$OUT/eager_triton_fs0.json"
want peer && step peer 60 torchrun --nproc-per-node 1 benchmarks/peer_bench.py --json "$OUT/peer_bench.json"
want epb && step epb 60 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --wires bf16 --json "$OUT/ep_bench_bf16.json"
want layer && step layer 60 torchrun --nproc-per-node 1 benchmarks/moe_graph_bench.py --tokens 128 4096 \
    --json "$OUT/moe_graph.json"
want run && step run 140 python -m tritonep.cli.main run --steps 3 --json "$OUT/run_w1.json"
cat "$OUT/summary.txt"
cd "$OUT" && tar czf logs.tgz *.log *.json summary.txt 2>/dev/null; rm -f *.log *.json summary.txt
