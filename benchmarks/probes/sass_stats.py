"""SASS statistics of the dispatch kernels of a wire at a GPU shape, compiled for sm_90 on a CPU (no GPU needed).

    PYTHONPATH=. python benchmarks/probes/sass_stats.py --wires fp8 mxfp4 [--profile deepseek-v3] [--stage-own 0|1]
        [--geometry bt=8,warps=8] [--combine] [--ops] [--json out.json]
    PYTHONPATH=. python benchmarks/probes/sass_stats.py --wires bf16 fp8 --counts '' xeb=8 xeb=8,xw=4 hg=512
        # the chunk histogram and counts exchange per tile variant at the profile's token count

A one-rank CPU world (Triton's interpreter) runs one dispatch with decoded rows and one with rows kept quantized
(``keep_quantized=True``, what the ep_bench ``*.kept`` graph rows time) of an EPBuffer of the shape of a profile of
:mod:`tritonep.bench.profiles` (hidden, experts, top-k; its token count picks the tiles) with the
kernel tiles the GPU table picks for it (:func:`tests.support.tiles.tiles_of` with device ``cuda``: for DeepSeek-V3
at world 1, 16 tokens x 1024 columns, 16 warps, 132 programs for the quantized wires), recording every launch
(:mod:`tests.support.compile_check`). Rows move only for a few tokens (the interpreter is slow); the compiled kernels
are the same (token counts are runtime arguments). Each recorded send / expand variant is compiled in a fresh
process for sm_90 with ``HAS_TIMER=True`` (the GPU variant: the codecs' inline-PTX FAST paths), its cubin
disassembled with the ``cuobjdump`` Triton bundles, and ``ptxas -v`` run on its PTX. Printed per kernel:

* registers, spill bytes stored / loaded (ptxas -v), local memory per thread, shared memory per block;
* static SASS instruction counts, total and by class (``shared`` LDS/STS = shared-memory shuffles, ``shfl`` warp
  shuffles, ``int`` integer ALU, ``fp`` float ALU, ``cvt`` conversions F2F/F2I/I2F/F2FP, ``ldg``/``stg`` global
  loads / stores, ``local`` LDL/STL spills, ``uniform`` U* datapath, ``ctrl`` branches / barriers, ``move``);
* ``elem/thr``: elements of one [BT, BH] tile per thread (the divisor for a per-element figure).

Static counts are a proxy: the hidden loop body appears once (it runs H / BH times), the K routes' stores are
unrolled. They tell where a kernel's instructions go and whether a change removes some, not its time: a GPU run times
it (``bash scripts/gpu.sh wires``). ``--stage-own`` overrides the wire codec's ``stage_own`` for this probe only
(a tree without that field ignores ``--stage-own`` 0). Run it in another checkout with that checkout first on
PYTHONPATH to compare trees (the probe imports ``tritonep`` and ``tests.support`` from PYTHONPATH).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

KERNELS = ("dispatch_send_kernel", "dispatch_expand_kernel", "dispatch_fused_kernel")
COUNT_KERNELS = ("chunk_hist_kernel", "exchange_kernel")
COUNT_HIDDEN = 128  # the count kernels take no hidden size: a narrow buffer records them at the profile's tokens
COMBINE_KERNELS = ("combine_partial_kernel", "combine_out_kernel", "combine_fused_kernel")

CLASSES = {
    "shared": ("LDS", "STS", "LDSM", "ATOMS", "STSM"),
    "shfl": ("SHFL",),
    "int": ("IADD3", "IADD", "IMAD", "IMUL", "LOP3", "LOP", "SHF", "SHL", "SHR", "ISETP", "IMNMX", "VIMNMX", "LEA",
            "LEA.HI", "IABS", "POPC", "FLO", "BREV", "PRMT", "SEL", "BMSK", "SGXT", "ICMP", "IDP", "VIADD", "PLOP3",
            "P2R", "R2P", "VIADDMNMX", "IMNMX3"),
    "fp": ("FADD", "FMUL", "FFMA", "FSETP", "FMNMX", "FSEL", "MUFU", "FCHK", "FSET", "HADD2", "HMUL2", "HFMA2",
           "FMNMX3", "FSWZADD"),
    "cvt": ("F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND", "I2I", "F2IP"),
    "ldg": ("LDG", "LD", "LDGSTS", "LDC", "ULDC"),
    "stg": ("STG", "ST", "RED", "ATOM", "ATOMG"),
    "local": ("LDL", "STL"),
    "move": ("MOV", "S2R", "S2UR", "CS2R", "R2UR", "MOV32I", "SHFL.IDX"),
    "ctrl": ("BRA", "BSSY", "BSYNC", "EXIT", "BAR", "WARPSYNC", "NOP", "CALL", "RET", "YIELD", "BREAK", "JMP",
             "MEMBAR", "FENCE", "CCTL", "ERRBAR", "VOTE", "VOTEU", "NANOSLEEP", "BPT", "DEPBAR", "ELECT", "ACQBULK",
             "UCGABAR_ARV", "UCGABAR_WAIT", "PREEXIT"),
}
_OP_CLASS = {op: cls for cls, ops in CLASSES.items() for op in ops}


def op_class(mnemonic: str) -> str:
    """Class of one SASS mnemonic (its base before the first dot); ``uniform`` for the U* datapath ops the table
    does not name, ``other`` otherwise."""
    base = mnemonic.split(".")[0]
    if base in _OP_CLASS:
        return _OP_CLASS[base]
    if base.startswith("U") and base[1:] in _OP_CLASS:
        return "uniform"
    return "other"


def sass_counts(sass: str) -> tuple[int, dict, dict]:
    """(total, by class, by mnemonic base) of the instructions in a ``cuobjdump -sass`` listing."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        text = m.group(1).strip()
        if text.startswith("@"):
            text = text.split(None, 1)[1] if " " in text else ""
        if text:
            ops.append(text.split()[0])
    by_class = collections.Counter(op_class(o) for o in ops)
    by_op = collections.Counter(o.split(".")[0] for o in ops)
    return len(ops), dict(by_class), dict(by_op)


def _bin(tool: str) -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", tool)


def apply_stage_own(stage_own) -> list:
    """Set ``stage_own`` of every quantized wire's codec in the wire registry (this process only; None: nothing);
    returns the wires changed. Also ``probes/stage_own_bench.py``'s."""
    if stage_own is None:
        return []
    import dataclasses

    from tritonep.wire.formats import WIRES, get_wire

    changed = []
    for name in WIRES:
        fmt = get_wire(name)
        codec = fmt.codec
        if not codec.quantized:
            continue
        if not hasattr(codec, "stage_own"):
            if stage_own:
                raise SystemExit("--stage-own 1: this tree's codecs have no stage_own")
            continue
        if codec.stage_own != bool(stage_own):
            object.__setattr__(fmt, "codec", dataclasses.replace(codec, stage_own=bool(stage_own)))
            changed.append(name)
    return changed


def stats_of(rec: dict) -> dict:
    """Compile one recorded launch for sm_90 (this process must import the kernels compiled) and return its stats."""
    from tests.support.compile_check import compile_one

    k = compile_one(rec)
    out = dict(name=rec["name"], shared=k.metadata.shared)
    with tempfile.TemporaryDirectory() as d:
        cub, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cub, "wb") as f:
            f.write(k.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        v = subprocess.run([_bin("ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(d, "v.cubin")],
                           capture_output=True, text=True, check=True)
        vt = v.stdout + v.stderr
        num = lambda pat: int(re.search(pat, vt).group(1))  # noqa: E731
        out.update(registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                   spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"))
        res = subprocess.run([_bin("cuobjdump"), "-res-usage", cub], capture_output=True, text=True, check=True).stdout
        m = re.search(r"LOCAL:(\d+)", res)
        out["local"] = int(m.group(1)) if m else 0
        sass = subprocess.run([_bin("cuobjdump"), "-sass", cub], capture_output=True, text=True, check=True).stdout
    out["total"], out["classes"], out["ops"] = sass_counts(sass)
    return out


def _child(path: str, stage_own) -> None:
    """Compiled-mode child: the records in ``path`` -> one stats dict each, printed as one ``@@`` JSON line."""
    apply_stage_own(stage_own)
    res = []
    with open(path) as f:
        recs = json.load(f)
    for r in recs:
        try:
            res.append(dict(stats_of(r), label=r.get("label", "")))
        except Exception as e:  # report the failure, go on with the others
            res.append(dict(name=r["name"], label=r.get("label", ""), error=repr(e)[-1500:]))
    print("@@" + json.dumps(res))


def _record_counts(group, a, wire: str) -> list:
    """The chunk histogram and counts exchange launches of one dispatch per ``--counts`` variant, at the profile's
    token count (their tiles follow ``max_tokens_per_rank``) and the wire's GPU token tile and warps (a narrow hidden
    size: these kernels take none), labelled ``wire.variant``."""
    import tritonep as tep
    from tests.support.compile_check import record_launches
    from tests.support.tiles import tiles_of
    from tritonep.bench.cases import make_rank_inputs

    g = tiles_of("cuda", 1, a.hidden, a.tokens, a.topk, wire)
    out = []
    for var in a.counts:
        geo = f"bt={g.bt},warps={g.num_warps},hg={g.grid_hist},dec=0" + ("," + var if var else "")
        b = tep.EPBuffer(group, a.experts, COUNT_HIDDEN, a.tokens, a.topk, dispatch_wire=wire, combine_wire=wire,
                         tiles=geo)
        x, i, w = make_rank_inputs(0, min(9, a.tokens), COUNT_HIDDEN, a.experts, a.topk, seed=3)
        recs = []
        with record_launches(recs):
            b.dispatch(x, i, w)
        out += [dict(r, constexprs=dict(r["constexprs"], **({"HAS_TIMER": True} if "HAS_TIMER" in r["constexprs"]
                                                             else {})), label=f"{wire}.{var or 'table'}")
                for r in recs if r["name"] in COUNT_KERNELS]
        b.close()
    return out


def _record(group, a):
    """Rank body of the CPU world: one decoded and one kept dispatch per wire at the GPU tiles; the send / expand
    launches of each, labelled (with ``--counts``: the count kernels' launches per variant instead)."""
    import tritonep as tep
    from tests.support.compile_check import record_launches
    from tests.support.tiles import tiles_of

    apply_stage_own(a.stage_own)
    from tritonep.bench.cases import make_rank_inputs

    if a.counts is not None:
        return [r for wire in a.wires for r in _record_counts(group, a, wire)]
    out = []
    for wire in a.wires:
        g = tiles_of("cuda", 1, a.hidden, a.tokens, a.topk, wire)
        geo = (f"bt={g.bt},bh={g.bh},warps={g.num_warps},cbt={g.cbt},cwarps={g.cwarps},dec=0,pf={int(g.prefetch)},"
               f"fs={g.fused_send},fe={g.fused_expand}")
        if not g.fused_send:
            geo += f",grid={g.grid_send}"
        if a.geometry:  # a tile variant on top of the table's (later entries win)
            geo += "," + a.geometry
        b = tep.EPBuffer(group, a.experts, a.hidden, 16, a.topk, dispatch_wire=wire, combine_wire=wire, tiles=geo)
        x, i, w = make_rank_inputs(0, 9, a.hidden, a.experts, a.topk, seed=3)
        modes = [("decoded", False)] + ([("kept", True)] if wire != "bf16" else [])
        for mode, keep in modes:
            recs = []
            with record_launches(recs):
                b.dispatch(x, i, w, keep_quantized=keep) if keep else b.dispatch(x, i, w)
            for r in recs:
                if r["name"] in KERNELS:
                    r = dict(r, constexprs=dict(r["constexprs"], HAS_TIMER=True), label=f"{wire}.{mode}")
                    out.append(r)
        if a.combine:
            d = b.dispatch(x, i, w)
            recs = []
            with record_launches(recs):
                b.combine(d.x, d.handle)
            out += [dict(r, constexprs=dict(r["constexprs"], HAS_TIMER=True), label=f"{wire}.combine")
                    for r in recs if r["name"] in COMBINE_KERNELS]
        b.close()
    return out


def _elem_per_thread(rec: dict) -> float:
    c = rec.get("constexprs", {})
    return c.get("BT", 0) * c.get("BH", 0) / (32 * (rec.get("options") or {}).get("num_warps", 4))


SHOWN = ("shared", "shfl", "int", "fp", "cvt", "ldg", "stg", "local", "uniform", "move", "ctrl", "other")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wires", nargs="+", default=["fp8", "mxfp4"])
    ap.add_argument("--profile", default="deepseek-v3", help="shape: a profile of tritonep/bench/profiles.py")
    ap.add_argument("--stage-own", type=int, choices=(0, 1), default=None)
    ap.add_argument("--geometry", default="", help="a TRITONEP_GEOMETRY string applied on top of the table's tiles, "
                                                   "e.g. 'bt=8,warps=8'")
    ap.add_argument("--combine", action="store_true", help="also the combine's kernels (push combine at the tiles)")
    ap.add_argument("--ops", action="store_true", help="also print the 12 most frequent mnemonics per kernel")
    ap.add_argument("--counts", nargs="*", default=None, metavar="GEOMETRY",
                    help="instead: the chunk histogram and counts exchange per tile variant ('' = the table's; e.g. "
                         "'xeb=8' 'xeb=8,xw=4' 'hg=512'), at the profile's token count")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"
    from tritonep.bench.profiles import profile_shape
    from tritonep.testing import run_cpu_world

    a.hidden, a.experts, a.topk, a.tokens = profile_shape(a.profile)

    recs = run_cpu_world(1, _record, a, timeout_s=1800)[0]
    seen, uniq = set(), []
    for r in recs:  # the kept and decoded calls share their send kernel: compile each variant once
        key = json.dumps({k: r[k] for k in ("name", "signature", "constexprs", "options")}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            uniq.append(r)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(uniq, f)
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = (f"import sys; sys.path[:0] = {sys.path[:1]!r}\nimport sass_stats\n"
            f"sass_stats._child({f.name!r}, {a.stage_own!r})\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    os.unlink(f.name)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if not line:
        print(p.stderr[-3000:])
        return 1
    stats = json.loads(line[-1][2:])
    import tritonep

    print(f"tritonep from {os.path.dirname(tritonep.__file__)}; profile {a.profile} (hidden {a.hidden}, experts "
          f"{a.experts}, top-{a.topk}, tiles for {a.tokens} tokens at world 1); sm_90, HAS_TIMER=True")
    hdr = (f"{'variant':<22} {'kernel':<22} {'regs':>4} {'spill st/ld':>11} {'local':>5} {'smem':>6} {'total':>6} "
           + " ".join(f"{c:>7}" for c in SHOWN) + f" {'elem/thr':>8}")
    print(hdr)
    bad = 0
    for r, s in zip(uniq, stats):
        if "error" in s:
            print(f"{s['label']:<22} {s['name']:<22} FAILED {s['error']}")
            bad += 1
            continue
        print(f"{s['label']:<22} {s['name'].replace('dispatch_', '')[:22]:<22} {s['registers']:>4} "
              f"{s['spill_stores']:>5}/{s['spill_loads']:<5} {s['local']:>5} {s['shared']:>6} {s['total']:>6} "
              + " ".join(f"{s['classes'].get(c, 0):>7}" for c in SHOWN) + f" {_elem_per_thread(r):>8.0f}")
        if a.ops:
            top = sorted(s["ops"].items(), key=lambda kv: -kv[1])[:12]
            print("    " + " ".join(f"{k}:{v}" for k, v in top))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(s, constexprs=r["constexprs"], options=r.get("options")) for r, s in zip(uniq, stats)],
                      f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
