#!/usr/bin/env bash
# The one GPU runner: named suites, each sized to fit one 10-minute device command (timeout_s=600) with cold Triton
# caches on one H100 / H200. Run from the repository root on the GPU machine:
#   bash scripts/gpu.sh SUITE [SUITE ...]
# Suites (limits in seconds are each step's own; measured times in docs/gpu.md):
#   single   world-1 GPU tests (one process, one GPU)                                      limit 360
#   mps2     every multi-rank GPU test at W=2, ranks sharing the GPU under MPS             limit 480
#   mps4     every multi-rank GPU test at W=4 under MPS                                     limit 480
#   ts2/ts4  the same, time-sliced (no MPS)                                                 limit 500 / 520
#   soak     the 1000-replay CUDA-graph soaks at W=2 under MPS                              limit 150
#   suite1   the whole GPU suite's first command: `single` (one process, no MPS) running beside `mps2` (the
#            ranks' private MPS daemon): compiles are CPU-bound and the machine has 16 cores; then the tests
#            marked `alone` (they measure the whole GPU's free memory), with nothing beside them         545 + 45
#   suite2   its second command: `mps4` but the DeepEP-compatible Buffer's tests (they run at W = 1 and 2 in
#            suite1, at W = 3, 4, 8 in the CPU worlds), then `soak`                                   470 + 110
#   runs2    `tritonep run` at W=2 under MPS: every layer; balance none / virtual, push / pull, bf16 / fp8
#   runs4    the same at W=4 under MPS
#   run2/run4  `tritonep run` at W=2 / W=4 under MPS, the default recipe only                   limit 150
#   caps     dispatch / combine / backward exact at every program cap (world 1 and W=2 under MPS)
#   probe    does a rank's random draw depend on the SM share MPS gives it (benchmarks/probes/mps_sm_share.py)
#   bench    world-1 benchmarks: dispatch / combine vs NCCL, eager vs graph, the MoE layer's step in one graph,
#            the planner (limits 170 + 120 + 120 + 80); their JSON in $OUT for scripts/results_index.py add
#   peers    vs torchtitan 0.3.0: dispatch + combine vs MinimalAsyncEP, torchtitan's MoE layer with each
#            dispatcher, eager (limits 150 + 150); needs the wheels in .whl/ (carry it; see `wheels`)
#   titanc   torchtitan's MoE layer compiled (torch.compile fullgraph) per dispatcher               limit 420
#   compat   the DeepEP-compatible Buffer's benchmark vs EPBuffer (benchmarks/deep_ep_compat.py)             limit 240
#   wires    world 1, DeepSeek-V3 shape: dispatch (decoded and rows kept quantized) and combine per wire, graph-
#            replayed, with the HBM copy rate beside them; WIRE_VARIANTS="deepseek-v3:0:fp8+mxfp4:bt=8 ..." adds
#            tile variants; then the combine backward (eager_profile, 4096 tokens; BWD_VARIANTS="bbt=4,bwarps=8 ..."
#            adds its tile variants)                                                  limits 300 + 120 per run
#   coldstart  `tritonep run`, first layer, from an empty Triton cache at W = 1 and W = 4 (MPS): the step's wall
#            time is the cold start (JIT compile included)                                limits 300 + 300
#   kernels  world 1, DeepSeek-V3 shape, the table's tiles: each kernel's time per call (dispatch, rows kept quantized,
#            combine, combine backward; KB_VARIANTS="name=bt=4,pf=1 ..." adds tile variants), then the same calls
#            under Nsight Compute (throughput, memory, warp stalls, occupancy per kernel)          limits 150 + 300
#   stageown  world 1, DeepSeek-V3 shape: the mxfp4 dispatch as the table runs it (the expander encodes the own rows,
#            8-token tiles), then with its sender staging them (benchmarks/probes/stage_own_bench.py --stage-own 1) at
#            8- and 16-token tiles                                                            limits 150 + 200
#   chain    world 1, DeepSeek-V3 shape: the small kernels before the expand (chunk histogram, counts exchange) per
#            tile variant (CHAIN_VARIANTS="name=xeb=8,hg=512,xw=4 ...": hg histogram programs, xeb exchange experts
#            per tile, xw their warps), each kernel's time, then the dispatch graph-replayed per variant
#            (CHAIN_BENCH="hg=512,xeb=8 ...")                                                    limits 200 + 240
#   compatprof  where the compat Buffer's eager round trip spends its time (benchmarks/probes/compat_profile.py)  150
#   memcheck an overflowing sync-free step + backward under compute-sanitizer memcheck, world 1 and W = 2
#            time-sliced (benchmarks/probes/overflow_memcheck.py)                                  limits 200 + 240
#   wheels   NOT on the GPU machine: on a machine with internet, download into .whl/ the pure-Python wheels the
#            peers / titanc suites need (torchtitan 0.3.0 and its imports beyond torch); then carry .whl
# Every step's log and JSON go to $WORK (default /tmp/gpu_work), packed after every step into $OUT/logs.tgz with a
# verdict line per step in $OUT/summary.txt (what comes back from the device); the benchmark JSONs also go to $OUT.
# Past its limit a step gets SIGINT (pytest then prints its failures and durations so far), SIGKILL 15 s later.
# TESTS="path ..." limits the pytest suites to those files or folders (default: tests). Multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels() {  # the torchtitan benchmarks' wheels into .whl/ (pure Python: only the Python version is pinned)
    mkdir -p .whl
    local req
    for req in "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro==1.0.17" "docstring-parser==0.18.0" \
               "typeguard==4.6.1" "typing-extensions==4.16.0"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PY:-3.12}" -d .whl "$req" \
            || return 1
    done
    ls -l .whl
}
if [ "$*" = wheels ]; then wheels; exit $?; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-gpu_out}
WORK=${WORK:-/tmp/gpu_work}
mkdir -p "$OUT" "$WORK"

pack() {  # atomic: steps running beside each other pack too
    tar czf "$OUT/.logs.$$.$BASHPID.tgz" -C "$WORK" . 2>/dev/null && mv -f "$OUT/.logs.$$.$BASHPID.tgz" "$OUT/logs.tgz"
    cp "$WORK/summary.txt" "$OUT/.summary.$BASHPID" 2>/dev/null && mv -f "$OUT/.summary.$BASHPID" "$OUT/summary.txt"
}
step() {  # step NAME LIMIT_S CMD...: CMD under its limit, logged to $WORK/NAME.log, a verdict line
    local name=$1 limit=$2; shift 2
    local t0
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Warning:|warnings\.warn|_warn_once" \
        > "$WORK/$name.log"
    local rc=${PIPESTATUS[0]}
    tail -"${TAIL:-8}" "$WORK/$name.log"
    echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$WORK/summary.txt"
    pack
}
stop_leftover_mps() {  # a world killed outright could leave its private daemon: quit it by its own pipe folder
    local d
    for d in "${TMPDIR:-/tmp}"/tritonep_world_*/mps_pipe; do
        [ -e "$d" ] || continue
        echo "leftover MPS daemon at $d: quitting it"
        echo quit | CUDA_MPS_PIPE_DIRECTORY="$d" CUDA_MPS_LOG_DIRECTORY="${d%/mps_pipe}/mps_log" timeout 20 \
            nvidia-cuda-mps-control || true
        rm -rf "${d%/mps_pipe}"
    done
}
read -r -a TEST_PATHS <<< "${TESTS:-tests}"
PYTEST=(python -m pytest -v -ra -p no:cacheprovider --durations=30 "${TEST_PATHS[@]}")
RUN=(python -m tritonep.cli.main run)

run_base() {  # run_base W: `tritonep run` under MPS at W ranks, every layer of the default trace, default recipe
    step "run${1}_none_push_bf16" 150 "${RUN[@]}" --world-size "$1" --mps on --json "$WORK/run${1}_none_push_bf16.json"
    stop_leftover_mps
}
run_matrix() {  # run_matrix W: the base run, then the other recipes (balance, combine kind, wires)
    local W=$1
    run_base "$W"
    step "run${W}_virtual_pull_bf16" 150 "${RUN[@]}" --world-size "$W" --mps on --balance virtual --combine pull \
        --json "$WORK/run${W}_virtual_pull_bf16.json"
    stop_leftover_mps
    step "run${W}_none_pull_fp8" 150 "${RUN[@]}" --world-size "$W" --mps on --combine pull --dispatch-wire fp8 \
        --json "$WORK/run${W}_none_pull_fp8.json"
    stop_leftover_mps
    step "run${W}_virtual_push_fp8" 150 "${RUN[@]}" --world-size "$W" --mps on --balance virtual --dispatch-wire fp8 \
        --combine-wire fp8 --json "$WORK/run${W}_virtual_push_fp8.json"
    stop_leftover_mps
}

use_wheels() {  # the carried wheels installed into $WORK/site (the GPU machine has no internet), put on PYTHONPATH
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'bash scripts/gpu.sh wheels' on a machine with internet"
                                       echo "and carry .whl"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$WORK/site"
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
nvidia-smi -L
command -v nvidia-cuda-mps-control >/dev/null || echo "nvidia-cuda-mps-control not found: the MPS suites will fail"
for suite in "$@"; do
    case "$suite" in
        single) step single 360 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak and not caps" --timeout 200 ;;
        mps2) step mps2 480 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak and not caps" --gpu-world-sizes 2 \
                  --gpu-mps on --timeout 120 --maxfail 4 ;;
        mps4) step mps4 480 "${PYTEST[@]}" -m "gpu and anyworld and not soak and not caps" --gpu-world-sizes 4 --gpu-mps on \
                  --timeout 120 --maxfail 4 ;;
        ts2) step ts2 500 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak and not caps" --gpu-world-sizes 2 \
                 --timeout 200 --maxfail 8 ;;
        ts4) step ts4 520 "${PYTEST[@]}" -m "gpu and anyworld and not soak and not caps" --gpu-world-sizes 4 --timeout 200 \
                 --maxfail 8 ;;
        soak) step soak 150 "${PYTEST[@]}" -m "gpu and soak" --gpu-world-sizes 2 --gpu-mps on --timeout 140 ;;
        suite1) TAIL=4 step single 360 "${PYTEST[@]}" -m "gpu and (not world or world1) and not soak and not caps \
                    and not alone" --timeout 200 &
                beside=$!
                step mps2 545 "${PYTEST[@]}" -m "gpu and world and not world1 and not soak and not caps" \
                    --gpu-world-sizes 2 --gpu-mps on --timeout 120 --maxfail 4
                stop_leftover_mps
                wait "$beside"
                step alone 45 "${PYTEST[@]}" -m "gpu and alone" --timeout 40  # nothing beside it now
                pack ;;
        suite2) step mps4 470 "${PYTEST[@]}" -m "gpu and anyworld and not soak and not caps" --gpu-world-sizes 4 \
                    --gpu-mps on --timeout 120 --maxfail 4 --ignore=tests/compat  # compat: W = 1 and 2 (suite1)
                stop_leftover_mps
                step soak 110 "${PYTEST[@]}" -m "gpu and soak" --gpu-world-sizes 2 --gpu-mps on --timeout 100
                pack ;;
        run2) run_base 2 ;;
        run4) run_base 4 ;;
        runs2) run_matrix 2 ;;
        runs4) run_matrix 4 ;;
        caps) step caps1 200 "${PYTEST[@]}" -m "gpu and caps and world1" --timeout 180
              step caps2 300 "${PYTEST[@]}" -m "gpu and caps and not world1" --gpu-world-sizes 2 --gpu-mps on \
                  --timeout 280 ;;
        probe) step probe 120 python benchmarks/probes/mps_sm_share.py --world-size 2 --mps on \
                   --json "$WORK/probe_w2.json"
               step probe4 120 python benchmarks/probes/mps_sm_share.py --world-size 4 --mps on \
                   --json "$WORK/probe_w4.json" ;;
        bench) step ep_bench 170 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --profiles deepseek-v3 decode \
                   --wires bf16 --json "$OUT/ep_bench.json"
               step eager_profile 120 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 1024 4096 \
                   --json "$OUT/eager_profile.json"
               step moe_graph 120 torchrun --nproc-per-node 1 benchmarks/moe_bench.py --graph --tokens 128 4096 \
                   --json "$OUT/moe_bench_graph.json"
               step planner 80 python benchmarks/planner_bench.py --modes reference minimal \
                   --json "$OUT/planner_bench.json" ;;
        peers) use_wheels || exit 2
               step peer_bench 150 torchrun --nproc-per-node 1 benchmarks/peer_bench.py --json "$OUT/peer_bench.json"
               step titan_bench 150 torchrun --nproc-per-node 1 benchmarks/titan_bench.py --no-compile \
                   --json "$OUT/titan_bench.json" ;;
        titanc) use_wheels || exit 2
                step titan_compiled 420 torchrun --nproc-per-node 1 benchmarks/titan_bench.py \
                    --json "$OUT/titan_bench_compiled.json" ;;
        chain) step chain_kernels 200 torchrun --nproc-per-node 1 benchmarks/probes/kernel_breakdown.py --wires bf16 fp8 \
                   --iters 10 --variants table= ${CHAIN_VARIANTS:-} --json "$OUT/chain_kernels.json"
               v=("deepseek-v3:0:bf16+fp8+mxfp4:"); for g in ${CHAIN_BENCH:-}; do v+=("deepseek-v3:0:bf16+fp8+mxfp4:$g"); done
               step chain_bench 240 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --num-sms --iters 20 \
                   --variants "${v[@]}" --json "$OUT/chain_bench.json" ;;
        compat) step deep_ep_compat 240 torchrun --nproc-per-node 1 benchmarks/deep_ep_compat.py \
                    --json "$OUT/deep_ep_compat.json" ;;
        wires) step wire_bench 300 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --num-sms --iters 20 \
                   --variants "deepseek-v3:0:bf16+fp8+mxfp4:" ${WIRE_VARIANTS:-} --json "$OUT/wire_bench.json"
               step wire_bwd 120 torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 4096 \
                   --json "$OUT/wire_bwd.json"
               i=0; for v in ${BWD_VARIANTS:-}; do  # combine-backward tile variants (bbt=..,bwarps=..,bgrid=..)
                   i=$((i + 1)); TRITONEP_GEOMETRY=$v step "wire_bwd_v$i" 120 torchrun --nproc-per-node 1 \
                       benchmarks/eager_profile.py --tokens 4096 --json "$OUT/wire_bwd_v$i.json"
               done ;;
        coldstart) step warm_imports 60 python -c "import torch, tritonep.cli.main; torch.zeros(1, device='cuda')"
                   for W in 1 4; do  # an empty Triton cache each (the file caches warm from the imports above)
                       TRITON_CACHE_DIR=$(mktemp -d) step "cold$W" 300 "${RUN[@]}" --world-size "$W" \
                           --mps "$([ "$W" = 1 ] && echo off || echo on)" --layers 2 --no-check --json "$WORK/cold$W.json"
                       stop_leftover_mps
                   done ;;
        kernels) step kernel_breakdown 150 torchrun --nproc-per-node 1 benchmarks/probes/kernel_breakdown.py --extra \
                     --iters 10 --variants table= ${KB_VARIANTS:-} --json "$OUT/kernel_breakdown.json"
                 # the same calls once under Nsight Compute: each expand / combine kernel's counters (fp8 first: -c
                 # caps the kernels profiled: 12 per quantized wire, 13 for bf16; probes/ncu_summary.py labels them)
                 step ncu 300 ncu --clock-control none --target-processes all -c 40 \
                     -k "regex:dispatch_expand_kernel|combine_partial_kernel|combine_out_kernel" \
                     --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                     --section Occupancy --section LaunchStats --section SchedulerStats \
                     torchrun --nproc-per-node 1 benchmarks/probes/kernel_breakdown.py --extra --iters 1 \
                     --wires fp8 mxfp4 bf16 --variants table=
                 python benchmarks/probes/ncu_summary.py "$WORK/ncu.log" --wires fp8 mxfp4 bf16 --extra \
                     --command "bash scripts/gpu.sh kernels" --json "$OUT/ncu_kernels.json" ;;
        stageown) step stage_own_0 150 torchrun --nproc-per-node 1 benchmarks/ep_bench.py --num-sms --iters 20 \
                      --variants "deepseek-v3:0:mxfp4:" "deepseek-v3:0:mxfp4:bt=16" --json "$OUT/stage_own_0.json"
                  step stage_own_1 200 torchrun --nproc-per-node 1 benchmarks/probes/stage_own_bench.py --stage-own 1 \
                      -- --num-sms --iters 20 --variants "deepseek-v3:0:mxfp4:" "deepseek-v3:0:mxfp4:bt=16" \
                      --json "$OUT/stage_own_1.json" ;;
        compatprof) step compat_profile 150 torchrun --nproc-per-node 1 benchmarks/probes/compat_profile.py ;;
        memcheck) SAN=(compute-sanitizer --tool memcheck --report-api-errors no --target-processes all --error-exitcode 3)
                  step memcheck1 200 "${SAN[@]}" python benchmarks/probes/overflow_memcheck.py --world-size 1
                  step memcheck2 240 "${SAN[@]}" python benchmarks/probes/overflow_memcheck.py --world-size 2 \
                      --mps off ;;
        wheels) echo "the wheels suite runs alone, on a machine with internet: bash scripts/gpu.sh wheels"; exit 2 ;;
        *) echo "unknown suite $suite"; sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
    esac
    stop_leftover_mps
done
cat "$WORK/summary.txt"
