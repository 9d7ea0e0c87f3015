# Sourced by the device scripts (scripts/gpu_1gpu.sh, gpu_sweep.sh, gpu_verify.sh): the repo root as working
# directory, the no-multicast environment, $OUT, and `step NAME LIMIT_S CMD...`, which runs CMD under its measured
# time limit, logs it line by line to $OUT/NAME.log (Python warning lines dropped, pytest's summary line kept), prints
# the last $TAIL lines. Past its limit CMD gets SIGINT (pytest then prints its failures and durations so far),
# SIGKILL 15 s later; it prints (default 6; STEP_TEE=1 streams the whole log) and the verdict, also into $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
step() {
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    if [ "${STEP_TEE:-0}" = 1 ]; then
        timeout -s INT -k 15 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Warning:|warnings\.warn|_warn_once" | tee "$OUT/$name.log"
    else
        timeout -s INT -k 15 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Warning:|warnings\.warn|_warn_once" > "$OUT/$name.log"
    fi
    local rc=${PIPESTATUS[0]}
    [ "${STEP_TEE:-0}" = 1 ] || tail -"${TAIL:-6}" "$OUT/$name.log"
    echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
}
# `use_wheels`: the carried wheels (.whl/, filled here by scripts/gpu_wheels.sh; the device has no internet) installed
# into /tmp/site and put on PYTHONPATH (torchtitan 0.3.0 for the peer / titan benchmarks; ninja for
# benchmarks/host_primitives.py --cpp), their scripts on PATH; nothing without .whl/.
use_wheels() {
    [ -d .whl ] || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="$PATH:/tmp/site/bin"
}
