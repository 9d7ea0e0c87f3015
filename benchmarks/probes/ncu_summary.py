"""One row per profiled kernel from Nsight Compute's text report of ``probes/kernel_breakdown.py`` (the ``ncu`` step
of ``bash scripts/gpu.sh kernels``): duration, DRAM throughput, registers, spill requests, occupancy, warp stalls.

    python benchmarks/probes/ncu_summary.py ncu.log --wires fp8 mxfp4 bf16 --extra --json $OUT/ncu_kernels.json

Each launch is labelled with the kernel_breakdown call that made it (:func:`launch_labels`: the calls of one variant
and wire in order, ``iters`` = 1, the two-kernel dispatch and push combine of the DeepSeek-V3 table at world 1); a
launch whose kernel name differs from the expected one is labelled ``?`` (another path or order: read the log). The
numbers are ncu's, as printed (its ``--clock-control none``: the GPU's own clocks).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METRICS = {  # row key -> (the metric's name in ncu's details page, the row's unit; "" when it has none)
    "duration_us": ("Duration", "us"), "dram_pct": ("DRAM Throughput", "%"), "mem_tbps": ("Memory Throughput", "Tbyte/s"),
    "l2_hit_pct": ("L2 Hit Rate", "%"), "regs": ("Registers Per Thread", "register/thread"), "block": ("Block Size", ""),
    "spill_requests": ("Local Memory Spilling Requests", ""), "occupancy_pct": ("Achieved Occupancy", "%"),
    "cycles_per_issue": ("Warp Cycles Per Issued Instruction", "cycle"),
    "eligible_warps": ("Eligible Warps Per Scheduler", "warp"),
    "dyn_smem_kb": ("Dynamic Shared Memory Per Block", "Kbyte/block"),
}
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}  # ncu's byte prefixes are decimal (16.38 Kbyte = 16384 B)
_TIME = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def _unit_scale(printed: str, unit: str):
    """The factor that turns a value printed in ``printed`` into ``unit`` (ncu scales its units to the value: a
    kernel moving 2 GB/s prints ``Gbyte/s``, one of 1.2 ms ``ms``), or None when the two are not of one kind."""
    if printed == unit:
        return 1.0
    if unit == "us":
        return _TIME.get(printed)
    m, n = re.fullmatch(r"([KMGT]?)byte(/.+)", printed), re.fullmatch(r"([KMGT]?)byte(/.+)", unit)
    if m and n and m.group(2) == n.group(2):
        return _PREFIX[m.group(1)] / _PREFIX[n.group(1)]
    return None


_HEAD = re.compile(r"^  (\w+) \((\d+), 1, 1\)x\((\d+), 1, 1\)", re.M)


def launch_labels(wires, extra: bool) -> list[tuple[str, str]]:
    """``(kernel, label)`` per profiled launch (dispatch expand, combine partial / out) of one kernel_breakdown
    variant with ``iters`` 1, in launch order: per wire the warm-up dispatch and combine, the timed and the checked
    dispatch, the dispatch the combines use, the timed and the checked combine, then with ``extra`` the kept
    dispatch (timed, checked; quantized wires) or the combine backward (timed, checked, and the dispatch of its
    ``grad_y`` the check makes; bf16)."""
    from tritonep.wire.formats import get_wire

    ex, part, out = "dispatch_expand_kernel", "combine_partial_kernel", "combine_out_kernel"
    seq = []
    for w in wires:
        seq += [(ex, f"{w} dispatch warm-up"), (part, f"{w} combine warm-up"), (out, f"{w} combine warm-up"),
                (ex, f"{w} dispatch"), (ex, f"{w} dispatch check"), (ex, f"{w} dispatch for the combine"),
                (part, f"{w} combine"), (out, f"{w} combine"), (part, f"{w} combine check"),
                (out, f"{w} combine check")]
        if extra and get_wire(w).quantized:
            seq += [(ex, f"{w} dispatch.kept"), (ex, f"{w} dispatch.kept check")]
        if extra and w == "bf16":
            seq += [(ex, f"{w} combine_backward"), (ex, f"{w} combine_backward check"),
                    (ex, f"{w} dispatch of grad_y (check)")]
    return seq


def _number(text: str):
    try:
        v = float(text.replace(",", ""))
    except ValueError:
        return None
    return int(v) if v.is_integer() and "." not in text else v


def parse(text: str, wires=(), extra: bool = False) -> list[dict]:
    """Rows (dicts: kernel, label, grid, block and :data:`METRICS`, each in the row's unit whatever unit ncu scaled
    it to; a metric ncu did not print is absent) of an ncu text report, in launch order; ``stall_l1tex_cycles``: the
    cycles a warp waits on an L1TEX scoreboard between two issues (ncu's rule text), when printed."""
    heads = list(_HEAD.finditer(text))
    labels = launch_labels(wires, extra) if wires else []
    rows = []
    for i, m in enumerate(heads):
        body = text[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        row = dict(kernel=m.group(1), grid=int(m.group(2)), block=int(m.group(3)))
        if i < len(labels):
            row["label"] = labels[i][1] if labels[i][0] == row["kernel"] else "?"
        for key, (name, unit) in METRICS.items():
            for v in re.finditer(rf"^\s+{re.escape(name)}\s+(?:(\S+)\s+)?([\d,]+(?:\.\d+)?)\s*$", body, re.M):
                scale = _unit_scale(v.group(1) or "", unit)
                if scale is not None and _number(v.group(2)) is not None:  # the first line of the metric's kind
                    row[key] = _number(v.group(2)) if scale == 1.0 else round(_number(v.group(2)) * scale, 6)
                    break
        # ncu wraps its rule text at a fixed width: the break can fall between any two of these words
        s = re.search(r"spends\s+([\d.]+)\s+cycles\s+being\s+stalled\s+waiting\s+for\s+a\s+scoreboard\s+"
                      r"dependency\s+on\s+a\s+L1TEX", body)
        if s:
            row["stall_l1tex_cycles"] = float(s.group(1))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="ncu's text output (the ncu step's log)")
    ap.add_argument("--wires", nargs="*", default=[], help="the kernel_breakdown run's --wires, in order (labels)")
    ap.add_argument("--extra", action="store_true", help="the kernel_breakdown run had --extra")
    ap.add_argument("--command", default="", help="the command that made the log (kept in the JSON's meta)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    with open(a.log) as f:
        rows = parse(f.read(), a.wires, a.extra)
    for r in rows:
        print(f"{r.get('label', ''):34s} {r['kernel']:24s} {r.get('duration_us', float('nan')):8.1f} us  "
              f"dram {r.get('dram_pct', 0):5.1f}%  regs {r.get('regs', 0):3d}  spill req {r.get('spill_requests', 0):>9}"
              f"  occ {r.get('occupancy_pct', 0):5.1f}%  l1tex stall {r.get('stall_l1tex_cycles', 0):4.1f}")
    if a.json:
        sys.path.insert(0, ROOT)
        from tritonep.bench.meta import run_meta  # the machine's GPU and versions (the log was made here)

        meta = run_meta(world_size=1, wires=a.wires, extra=a.extra, checked=None)
        if a.command:
            meta["command"] = a.command
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
