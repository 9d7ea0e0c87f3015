"""ep_bench with the quantized wires' ``stage_own`` flipped: does the dispatch of a wire run faster when its sender
stages the own rank's rows (the expander decodes / copies them like a peer's) or when the expander encodes them
from ``x`` itself (no staging write and read)?

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. \\
    torchrun --nproc-per-node 1 benchmarks/probes/stage_own_bench.py --stage-own 1 -- \\
        --num-sms --iters 20 --variants "deepseek-v3:0:mxfp4:bt=16" --json $OUT/stage_own1.json
    python benchmarks/probes/stage_own_bench.py --stage-own 1 -- --cpu --wires mxfp4   # the checks on a CPU world

Everything after ``--`` goes to ``benchmarks/ep_bench.py`` (every point checked as there). The codec's ``stage_own``
is replaced in this process's wire registry before any kernel is compiled (the compiled variant's key holds it:
:class:`tritonep.wire.kernels.wirecodec.DeviceCodec`), as ``probes/sass_stats.py --stage-own`` does for the SASS.
The JSON's ``meta`` gets ``stage_own`` (on rank 0, in the file this run wrote).
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_stats import apply_stage_own  # noqa: E402  (the registry flip, one place for both probes)


def _stamp(path: str):
    """``(mtime_ns, size)`` of the file at ``path``, None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mine, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage-own", type=int, choices=(0, 1), required=True)
    a = ap.parse_args(mine)
    if "--cpu" in rest:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    changed = apply_stage_own(bool(a.stage_own))
    print(f"stage_own={a.stage_own} for {', '.join(changed) or 'no wire (already so)'}", flush=True)
    from tests import load_script

    path = rest[rest.index("--json") + 1] if "--json" in rest else ""
    before = _stamp(path)
    code = load_script("benchmarks/ep_bench.py", "_ep_bench").main(rest)
    # the file ep_bench wrote: rank 0 writes it (the other ranks of a torchrun world must not read it while it is
    # written), and a file that was there before a run that wrote none keeps its own meta
    if path and int(os.environ.get("RANK", "0")) == 0 and _stamp(path) not in (None, before):
        with open(path) as f:
            d = json.load(f)
        d.setdefault("meta", {})["stage_own"] = a.stage_own
        with open(path, "w") as f:
            json.dump(d, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
