#!/usr/bin/env bash
# Issue 24, session 5 (2026-12-02): verification on ONE H200 in two device commands (timeout_s=600 each):
#   bash scripts/gpu_verify5.sh A     # single (world-1 GPU tests) eager eager_dec0 probe hostpy       ~330 s
#   bash scripts/gpu_verify5.sh B     # eager tests1 peer layer epb run (needs carry [".whl"])            ~400 s
# or name steps. Logs and JSON under $OUT, packed into $OUT/logs.tgz (the device returns few files).
source "$(dirname "$0")/gpu_step.sh"
steps=()
for a in "$@"; do
    case $a in
        A) steps+=(single eager eager_dec0 probe hostpy) ;;
        B) steps+=(eager tests1 peer layer epb run) ;;
        *) steps+=("$a") ;;
    esac
done
want() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
PYTEST=(python -m pytest -v -ra -p no:cacheprovider --durations=30 tests)
want single && OMP_NUM_THREADS=4 step single 230 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak" \
    --timeout 200
want eager && step eager 100 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 4096 \
    --json "$OUT/eager_triton.json"
want eager_dec0 && TRITONEP_GEOMETRY=dec=0 step eager_dec0 60 torchrun --nproc-per-node 1 \
    benchmarks/eager_profile.py --tokens 128 --json "$OUT/eager_triton_dec0.json"
want probe && step probe 60 torchrun --nproc-per-node 1 benchmarks/launch_probe.py --tokens 128 \
    --json "$OUT/launch_probe.json"
want hostpy && step hostpy 60 torchrun --nproc-per-node 1 benchmarks/host_profile.py --tokens 128 --calls 200 --top 25
want tests1 && OMP_NUM_THREADS=4 step tests1 150 python -m pytest -v -ra -p no:cacheprovider --durations=20 -m "gpu and (not world or world1) and not soak" \
    --timeout 120 tests/ep/test_combine_backward_rows.py tests/ep/triton/test_decode_gpu.py \
    tests/ep/nccl/test_bound_launches.py tests/ep/nccl/test_pinned_plan_gpu.py tests/ep/triton/test_own_rank_staging.py \
    tests/ep/triton/test_bound_direct.py tests/moe/test_sync_free.py
want peer && step peer 120 torchrun --nproc-per-node 1 benchmarks/peer_bench.py --json "$OUT/peer_bench.json"
want epb && step epb 90 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --wires bf16 --json "$OUT/ep_bench_bf16.json"
want layer && step layer 100 torchrun --nproc-per-node 1 benchmarks/moe_graph_bench.py --tokens 128 4096 \
    --json "$OUT/moe_graph.json"
want run && step run 140 python -m tritonep.cli.main run --steps 3 --json "$OUT/run_w1.json"
want mps2dec && step mps2dec 150 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak" -k "decode or sync_free" \
    --gpu-world-sizes 2 --gpu-mps on --timeout 120 --maxfail 4
cat "$OUT/summary.txt"
cd "$OUT" && tar czf logs.tgz *.log *.json summary.txt 2>/dev/null; rm -f *.log *.json summary.txt
