#!/usr/bin/env bash
# Issue 24, session 8 (2026-12-02): the output pool (tritonep/ep/pool.py) on ONE H200, one device command per
# letter (timeout_s=600 each), carry [".whl"] (torchtitan 0.3.0 for the peer benchmark):
#   bash scripts/gpu_verify8.sh A   # world-1 ep + moe GPU tests (incl. the pool's streams / capture test), the pool
#                                   #   test at W=2 under MPS, eager with the pool and without it (same call), probe
#   bash scripts/gpu_verify8.sh B   # final: W=2 MPS core (ep cases, graph replays, gradients, host protocol, decode
#                                   #   bf16, pool) and the rest (MoE layer, virtual experts, wires), eager, peer
#   bash scripts/gpu_verify8.sh C   # final: the world-1 GPU suite, `tritonep run`, the MoE layer eager vs graph, ep_bench
#   bash scripts/gpu_verify8.sh D   # the MoE layer eager vs graph, ep_bench bf16 (nccl backend vs the pipeline),
#                                   #   host cProfile at 1024 tokens (the fused path's host work)
#   bash scripts/gpu_verify8.sh E   # session 9 final: world-1 ep + moe GPU tests (incl. the nccl sync-free eager and
#                                   #   captured test), the pool at W=2, eager, ep_bench (nccl sync-free row), peer,
#                                   #   collective host costs
#   bash scripts/gpu_verify8.sh F   # session 10: the nccl GPU tests (both sync-free modes), the sync-free profile
#                                   #   one process per mode, ep_bench bf16 (the nccl decode rows)
#   bash scripts/gpu_verify8.sh G   # session 10: world-1 ep + moe GPU tests, the one-hop send launch's variants
#   bash scripts/gpu_verify8.sh H   # session 10 final: world-1 ep + moe GPU tests, the pool at W=2, eager, ep_bench,
#                                   #   peer, the sync-free profile per mode, the send probe, collective host costs
#   bash scripts/gpu_verify8.sh I   # session 10 last: nccl GPU tests, sync-free profile, send probe, ep_bench
#   bash scripts/gpu_verify8.sh J   # the whole world-1 GPU suite, then the W=2 MPS core (ranks sharing the GPU)
#   bash scripts/gpu_verify8.sh K   # session 11: nccl GPU tests, sync-free profile, collective host costs, ep_bench
#   bash scripts/gpu_verify8.sh L   # session 11: world-1 geometry sweep at 4096 tokens (bf16 dispatch + push combine,
#                                   #   graph replay), eager, peer (carry .whl)
#   bash scripts/gpu_verify8.sh M   # session 11 final: the whole world-1 GPU suite, ep_bench bf16
#   bash scripts/gpu_verify8.sh N   # session 11 final: the W=2 MPS core and the rest of the W=2 suite
#   bash scripts/gpu_verify8.sh O   # session 11 last: nccl + world-1 ep / moe GPU tests, sync-free profile, send
#                                   #   probe, ep_bench (the one-hop block with the row weights at offset 0)
#   bash scripts/gpu_verify8.sh P   # session 11 after the review fixes: nccl + world-1 ep / moe GPU tests, ep_bench
#   bash scripts/gpu_verify8.sh Q   # session 12: the packed launches (tritonep/ep/packed_launch.py): their GPU tests,
#                                   #   collective host costs (the wide launch three ways), eager with packed launches
#                                   #   and without (TRITONEP_PACKED_LAUNCH=0), world-1 ep / moe GPU tests
#   bash scripts/gpu_verify8.sh R   # session 12 final: packed-launch tests, world-1 ep / moe and nccl GPU tests,
#                                   #   collective host costs, eager both ways, the W=2 MPS core
#   bash scripts/gpu_verify8.sh S   # session 13 start: the whole world-1 GPU suite, the rest of the W=2 suite under
#                                   #   MPS (MoE layer, virtual experts, wires), eager, peer (carry .whl)
#   bash scripts/gpu_verify8.sh T   # session 13: the 4 world-1 GPU tests S ran out of time for, eager A/B against the
#                                   #   tree before the change (.base/tritonep, `git archive`: carry .base), world-1
#                                   #   ep / moe GPU tests, peer, `tritonep run` (carry .base and .whl)
#   bash scripts/gpu_verify8.sh U   # session 13: the W=2 MPS core (ranks sharing the GPU: the shared decode pool)
#   bash scripts/gpu_verify8.sh V   # session 13 final: the W=2 MPS core, then eager A/B with BOTH trees imported the
#                                   #   same way (.base/tritonep and .new/tritonep, `git archive`: carry both), three
#                                   #   alternations at 128 and 4096 tokens
#   bash scripts/gpu_verify8.sh W   # session 14 start: what each piece of the decode host path costs on this host
#                                   #   (benchmarks/host_primitives.py, with the C++ candidate: carry .whl for ninja),
#                                   #   eager twice
#   bash scripts/gpu_verify8.sh X   # session 14 final rows: host pieces (calibrated), eager three processes, peer,
#                                   #   `tritonep run`, the MoE layer eager vs graph, ep_bench bf16 (carry .whl)
#   bash scripts/gpu_verify8.sh Y   # session 14 final tests: the whole world-1 GPU suite (one step, 400 s), then the
#                                   #   W=2 MPS core
#   bash scripts/gpu_verify8.sh Z   # session 14: the decode ep_bench rows (nccl one-hop vs the pipeline), session
#                                   #   11's final tree (.base = `git archive 65cfba8 tritonep`) and this one (.new),
#                                   #   alternating twice (carry .base and .new)
# Logs and JSON under $OUT, packed into $OUT/logs.tgz.
source "$(dirname "$0")/gpu_step.sh"
steps=()
for a in "$@"; do
    case $a in
        A) steps+=(tests_ep pool_w2 eager eager_nopool probe) ;;
        B) steps+=(tests_w2 mps2rest eager peer) ;;
        C) steps+=(single run layer epb) ;;
        D) steps+=(layer epb hostpy1k) ;;
        E) steps+=(tests_ep pool_w2 eager epb peer coll) ;;
        F) steps+=(tests_nccl sfprof epb) ;;
        G) steps+=(tests_ep sendprobe) ;;
        H) steps+=(tests_ep pool_w2 eager epb peer sfprof sendprobe coll) ;;
        I) steps+=(tests_nccl sfprof sendprobe epb) ;;
        J) steps+=(single tests_w2) ;;
        K) steps+=(tests_nccl sfprof coll epb) ;;
        L) steps+=(sweep4k eager peer) ;;
        M) steps+=(single epb) ;;
        N) steps+=(tests_w2 mps2rest) ;;
        O) steps+=(tests_nccl tests_ep sfprof sendprobe epb) ;;
        P) steps+=(tests_nccl tests_ep epb) ;;
        Q) steps+=(packtest coll eager eager_tl tests_ep) ;;
        R) steps+=(packtest tests_ep tests_nccl coll eager eager_tl tests_w2) ;;
        S) steps+=(single mps2rest eager peer) ;;
        T) steps+=(rest4 eager_ab tests_ep peer run) ;;
        U) steps+=(tests_w2) ;;
        V) steps+=(tests_w2 eager_ab3) ;;
        W) steps+=(hostprim eager eager2) ;;
        X) steps+=(hostprim2 eager eager2 eager3 peer run layer epb) ;;
        Y) steps+=(single2 tests_w2) ;;
        Z) steps+=(epb_dec_ab) ;;
        *) steps+=("$a") ;;
    esac
done
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
use_wheels
PYT=(python -m pytest -v -ra -p no:cacheprovider --durations=30)
PYTEST=("${PYT[@]}" tests)
want tests_ep && OMP_NUM_THREADS=4 step tests_ep 150 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 100 tests/ep tests/moe/test_layer.py tests/moe/test_sync_free.py
want packtest && step packtest 120 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" --timeout 100 \
    tests/ep/test_packed_launch.py tests/ep/test_bound_launch.py tests/ep/triton/test_bound_direct.py
want tests_nccl && step tests_nccl 120 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" --timeout 100 \
    tests/ep/nccl
want sfprof && step sfprof_onehop 45 torchrun --nproc-per-node 1 benchmarks/nccl_sync_free_profile.py --tokens 128 \
    --modes onehop --json "$OUT/sfprof_onehop.json"
want sfprof && step sfprof_gather 45 torchrun --nproc-per-node 1 benchmarks/nccl_sync_free_profile.py --tokens 128 \
    --modes gather --json "$OUT/sfprof_gather.json"
want sendprobe && step sendprobe 60 torchrun --nproc-per-node 1 benchmarks/onehop_send_probe.py \
    --json "$OUT/onehop_send_probe.json"
want pool_w2 && step pool_w2 90 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" -k "output_pool" \
    --gpu-world-sizes 2 --gpu-mps on --timeout 80 --maxfail 1
want tests_w2 && step tests_w2 240 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    -k "test_gpu.py or host_protocol or (decode_gpu and bf16) or output_pool" --gpu-world-sizes 2 --gpu-mps on \
    --timeout 120 --maxfail 3
want mps2rest && step mps2rest 265 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" \
    -k "not (test_gpu.py or host_protocol or decode_gpu or output_pool)" --gpu-world-sizes 2 --gpu-mps on \
    --timeout 120 --maxfail 6
want single && OMP_NUM_THREADS=4 step single 290 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 200
want single2 && OMP_NUM_THREADS=4 step single2 400 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 200
want rest4 && step rest4 150 "${PYT[@]}" -m "gpu and (not world or world1) and not soak" --timeout 100 \
    tests/moe/test_ids_full_width.py tests/moe/test_layer.py tests/moe/test_virtual.py tests/wire/test_quantizers.py
# eager_ab: the tree before the change (.base/tritonep) and this one, alternating twice on the same host
if want eager_ab; then
    for r in 1 2; do
        for v in base new; do
            pp=.; [ $v = base ] && pp=.base
            PYTHONPATH=$pp python -c "import sys; sys.path.pop(0); import tritonep; print('tritonep from', tritonep.__file__)"
            PYTHONPATH=$pp step eager_${v}$r 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
                --tokens 128 1024 4096 --json "$OUT/eager_${v}$r.json"
        done
    done
fi
# eager_ab3: both trees through PYTHONPATH (same import path shape), three alternations
if want eager_ab3; then
    for r in 1 2 3; do
        for v in base new; do
            PYTHONPATH=.$v python -c "import sys; sys.path.pop(0); import tritonep; print('tritonep from', tritonep.__file__)"
            PYTHONPATH=.$v step eager_${v}$r 60 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
                --tokens 128 4096 --json "$OUT/eager_${v}$r.json"
        done
    done
fi
if want epb_dec_ab; then
    for r in 1 2; do
        for v in base new; do
            PYTHONPATH=.$v python -c "import sys; sys.path.pop(0); import tritonep; print('tritonep from', tritonep.__file__)"
            PYTHONPATH=.$v step epb_dec_${v}$r 60 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles decode \
                --wires bf16 --json "$OUT/ep_bench_decode_${v}$r.json"
        done
    done
fi
want eager && step eager 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 1024 4096 \
    --json "$OUT/eager_triton.json"
want eager2 && step eager2 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 1024 4096 \
    --json "$OUT/eager_triton2.json"
want eager3 && step eager3 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 1024 4096 \
    --json "$OUT/eager_triton3.json"
want hostprim && step hostprim 150 torchrun --nproc-per-node 1 benchmarks/host_primitives.py --cpp \
    --json "$OUT/host_primitives.json"
want hostprim2 && step hostprim2 60 torchrun --nproc-per-node 1 benchmarks/host_primitives.py \
    --json "$OUT/host_primitives2.json"
want eager_nopool && TRITONEP_OUTPUT_POOL=0 step eager_nopool 80 torchrun --nproc-per-node 1 \
    benchmarks/eager_profile.py --tokens 128 1024 4096 --json "$OUT/eager_triton_nopool.json"
want eager_tl && TRITONEP_PACKED_LAUNCH=0 step eager_tl 80 torchrun --nproc-per-node 1 benchmarks/eager_profile.py \
    --tokens 128 1024 4096 --json "$OUT/eager_triton_launcher.json"
want probe && step probe 50 torchrun --nproc-per-node 1 benchmarks/launch_probe.py --tokens 128 \
    --json "$OUT/launch_probe.json"
want peer && step peer 60 torchrun --nproc-per-node 1 benchmarks/peer_bench.py --json "$OUT/peer_bench.json"
want layer && step layer 60 torchrun --nproc-per-node 1 benchmarks/moe_graph_bench.py --tokens 128 4096 \
    --json "$OUT/moe_graph.json"
want epb && step epb 60 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --wires bf16 --json "$OUT/ep_bench_bf16.json"
want hostpy1k && step hostpy1k 60 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 1024 --calls 100 \
    --top 30
want coll && step coll 60 torchrun --nproc-per-node 1 benchmarks/collective_cost.py --json "$OUT/collective_cost.json"
SWEEP4K=("deepseek-v3:0:bf16:" "deepseek-v3:0:bf16:grid=264" "deepseek-v3:0:bf16:warps=16"
         "deepseek-v3:0:bf16:pf=1" "deepseek-v3:0:bf16:grid=264,warps=16" "deepseek-v3:0:bf16:grid=396"
         "deepseek-v3:0:bf16:bt=8" "deepseek-v3:0:bf16:grid=264,pf=1" "deepseek-v3:0:bf16:cbt=4"
         "deepseek-v3:0:bf16:cwarps=16" "deepseek-v3:0:bf16:grid=264,cbt=4,cwarps=16")
want sweep4k && TAIL=40 step sweep4k 240 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles deepseek-v3 \
    --wires bf16 --iters 20 --json "$OUT/sweep4k.json" --variants "${SWEEP4K[@]}"
want run && step run 140 python -m tritonep.cli.main run --steps 3 --json "$OUT/run_w1.json"
cat "$OUT/summary.txt"
cd "$OUT" && tar czf logs.tgz *.log *.json summary.txt 2>/dev/null; rm -f *.log *.json summary.txt
