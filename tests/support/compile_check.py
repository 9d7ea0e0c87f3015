"""Compile every kernel a CPU run launched for a real GPU target (sm_90), without a GPU.

The Triton interpreter accepts code that the compiler refuses (plain globals, some control flow, inline asm
arguments). :func:`record_launches` records every interpreted launch (kernel, argument types, constexprs);
:func:`compile_recorded` then compiles each distinct launch with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`` in a fresh process where the kernels are imported in compiled mode. Idea: the
offline-compile recipe of ../shared/reference/triton_symm_primer.md §4 item 4.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import torch

__all__ = ["record_launches", "record_launches_to", "read_records", "compile_recorded", "compile_one",
           "variant_key", "with_gpu_twins", "ptxas_usage", "usage_recorded"]

_DT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.int32: "i32",
       torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.bool: "i1",
       torch.float8_e4m3fn: "fp8e4nv"}


def _type_of(v):
    if isinstance(v, torch.Tensor):
        return "*" + _DT[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "constexpr"
    raise TypeError(f"cannot type kernel argument {v!r}")


def _launch_record(jitfn, args, kwargs) -> dict:
    """One interpreted launch of ``jitfn`` as a record: module, name, signature, constexprs, options."""
    import inspect

    import triton.language as tl

    names = jitfn.arg_names
    sig, const = {}, {}
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    pyfn = getattr(jitfn.fn, "fn", jitfn.fn)
    ann = {k: p.annotation for k, p in inspect.signature(pyfn).parameters.items()}
    for n in names:
        v = bound.get(n)
        is_const = "constexpr" in str(ann.get(n, "")) or ann.get(n) is tl.constexpr
        if is_const or v is None:
            sig[n] = "constexpr"
            const[n] = _const_to_json(v)
        else:
            sig[n] = _type_of(v)
    return dict(module=pyfn.__module__, name=pyfn.__name__, signature=sig, constexprs=const, options=opts)


@contextlib.contextmanager
def _recording(sink):
    """Call ``sink(record)`` for every interpreted launch of an importable kernel while the context is open."""
    from triton.runtime.interpreter import InterpretedFunction

    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            rec = _launch_record(self, args, kwargs)
            if getattr(sys.modules.get(rec["module"]), rec["name"], None) is not None:
                sink(rec)
        except Exception as e:  # recording must never break the run itself
            sink({"error": repr(e)})
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = orig


@contextlib.contextmanager
def record_launches(out: list):
    """Record interpreted launches into ``out`` (dicts: module, name, signature, constexprs, options)."""
    with _recording(lambda rec: out.append(rec) if rec not in out else None):
        yield out


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to ``path`` in ONE ``O_APPEND`` write (writers in forked processes do not
    interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@contextlib.contextmanager
def record_launches_to(path: str):
    """Append every distinct interpreted launch to the JSON-lines file ``path``, from this process and every process
    forked inside the context (the CPU world's ranks): one ``O_APPEND`` write per record, so forked writers do not
    interleave. Read back with :func:`read_records` (which drops the repeats of other processes)."""
    seen = set()

    def sink(rec):
        line = json.dumps(rec, sort_keys=True)
        if line not in seen:
            seen.add(line)
            append_line(path, line)

    with _recording(sink):
        yield path


def read_records(path: str) -> list:
    """The distinct records of a :func:`record_launches_to` file, in first-seen order."""
    out, seen = [], set()
    with open(path) as f:
        for line in f:
            if line.strip() and line not in seen:
                seen.add(line)
                out.append(json.loads(line))
    return out


# the fields of a wire codec a record carries beside its name (the scale dtype and tile functions are the name's)
_CODEC_FIELDS = ("block", "payload_bits", "scale_bytes", "stage_own")


def _const_to_json(v):
    """A constexpr as JSON: a wire codec (the kernels' ``WIRE``) by its wire name and its :data:`_CODEC_FIELDS`
    (``{"wire_codec": "mxfp4", "block": 32, ..., "stage_own": True}``: two codecs of one name that compile
    differently never record one key, also while a test has swapped the registry's codec), anything else as it is.

    Raises:
        ValueError: a codec whose scale dtype or tile functions are not its name's in the wire registry (a record
            could not name them)."""
    from tritonep.wire.kernels.wirecodec import DeviceCodec

    if not isinstance(v, DeviceCodec):
        return v
    from tritonep.wire import get_wire

    reg = get_wire(v.name).codec
    if (v.scale_dtype, v.encode, v.decode) != (reg.scale_dtype, reg.encode, reg.decode):
        raise ValueError(f"codec {v!r}: its scale dtype or tile functions are not the registry's {v.name!r} codec's")
    return {"wire_codec": v.name, **{f: getattr(v, f) for f in _CODEC_FIELDS}}


def _const_from_json(v):
    """Inverse of :func:`_const_to_json`: the registry's codec of the name with the recorded fields (a record of
    the name alone: the registry's codec)."""
    if isinstance(v, dict) and "wire_codec" in v:
        import dataclasses

        from tritonep.wire import get_wire

        return dataclasses.replace(get_wire(v["wire_codec"]).codec, **{f: v[f] for f in _CODEC_FIELDS if f in v})
    return v


# the kernel modules of an older layout -> where they live now: records made on an older tree (their ``module``)
# still compile here, under the same variant key (the key is the record's own), so a snapshot taken before a move
# compares with one taken after it
MOVED_MODULES = {
    **{f"tritonep.kernels.{m}": f"tritonep.device.{m}" for m in ("signal", "protocol", "common")},
    **{f"tritonep.kernels.{m}": f"tritonep.backends.triton.kernels.{m}"
       for m in ("combine", "combine_fused", "decode_combine", "decode_dispatch", "dispatch", "dispatch_fused",
                 "layout", "transport")},
    **{f"tritonep.kernels.nccl_{m}": f"tritonep.backends.nccl.kernels.{m}"
       for m in ("onehop", "plan", "reduce", "route", "unpack")},
    **{f"tritonep.kernels.{m}": f"tritonep.wire.kernels.{m}"
       for m in ("quant", "wire_quant", "wirecodec", "fp8_hw", "quant_e5m2")},
    **{f"tritonep.kernels.{m}": f"tritonep.balance.kernels.{m}" for m in ("planner", "planner_place")},
    **{f"tritonep.kernels.{m}": f"tests.support.{m}" for m in ("probe_fp8_hw", "probe_heap")},
    **{f"tests.ep.{m}": f"tests.runtime.{m}" for m in ("test_bound_launch", "test_packed_launch")},
    "tests.kernels.test_interpreter_speed": "tests.runtime.test_interpreter_speed",
}


def kernel_of(rec: dict):
    """The JIT function a record names, imported from its module (or where :data:`MOVED_MODULES` says it is now)."""
    import importlib

    mod = importlib.import_module(MOVED_MODULES.get(rec["module"], rec["module"]))
    return getattr(mod, rec["name"])


def normalized(rec: dict) -> dict:
    """The record as a launch of today's tree gives it: its module where the kernel lives now, and a constexpr
    recorded as None because the launch left it to its default (Triton then compiles the default) recorded as that
    default (a bound launch passes it explicitly). For comparing the launch sets of two trees."""
    import inspect

    import triton.language as tl

    fn = kernel_of(rec)
    pyfn = getattr(fn.fn, "fn", fn.fn) if hasattr(fn, "fn") else fn
    params = inspect.signature(pyfn).parameters
    sig, const = dict(rec["signature"]), dict(rec["constexprs"])
    for n, v in rec["constexprs"].items():
        p = params.get(n)
        d = p.default if p is not None else inspect.Parameter.empty
        if v is None and d is not inspect.Parameter.empty and d is not None:
            if "constexpr" in str(p.annotation) or p.annotation is tl.constexpr:
                const[n] = _const_to_json(d)
            else:  # a runtime parameter left to its default: Triton binds (and types) the default
                sig[n] = _type_of(d)
                del const[n]
    return dict(rec, module=pyfn.__module__, signature=sig, constexprs=const)


def compile_one(rec: dict):
    """Compile one recorded launch for sm_90 in this (non-interpreted) process; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_of(rec)
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if rec["signature"][n].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, rec["signature"], {k: _const_from_json(v) for k, v in rec["constexprs"].items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec.get("options") or {})


def with_gpu_twins(records: list) -> list:
    """The records without recording errors, plus a ``HAS_TIMER=True`` twin of each ``HAS_TIMER=False`` launch: the
    interpreter reads the host clock, the GPU takes the ``%globaltimer`` branch (and the FAST codec paths)."""
    recs = [r for r in records if "error" not in r]
    for r in list(recs):
        if r["constexprs"].get("HAS_TIMER") is False:
            twin = dict(r, constexprs=dict(r["constexprs"], HAS_TIMER=True))
            if twin not in recs:
                recs.append(twin)
    return recs


def compile_recorded(records: list, timeout_s: float = 600.0) -> list:
    """Compile each record in a fresh process (kernels imported in compiled mode); returns failures
    ``[(name, error text)]`` (empty = all compiled)."""
    recs = with_gpu_twins(records)
    payload = json.dumps(recs)
    code = ("import json,sys\nfrom tests.support.compile_check import compile_one\nrecs=json.loads(sys.stdin.read())\n"
            "bad=[]\nfor r in recs:\n    try:\n        compile_one(r)\n    except Exception as e:\n"
            "        bad.append([r['name'], repr(e)[-1500:]])\nprint('@@'+json.dumps(bad))\n")
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"  # compiled mode (tritonep sets 1 by default when there is no GPU)
    p = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, env=env,
                       timeout=timeout_s)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if not line:
        return [("<process>", p.stderr[-3000:])]
    return [tuple(x) for x in json.loads(line[-1][2:])] + [("<record>", r["error"]) for r in records if "error" in r]


def variant_key(rec: dict) -> str:
    """A launch variant's file stem: the kernel name and 16 hex digits of the SHA-256 of its canonical JSON
    (module, name, signature, constexprs, options), e.g. ``dispatch_send_kernel-0123456789abcdef``."""
    import hashlib

    canon = json.dumps({k: rec[k] for k in ("module", "name", "signature", "constexprs", "options")}, sort_keys=True)
    return f"{rec['name']}-{hashlib.sha256(canon.encode()).hexdigest()[:16]}"


def _write_ptx_main(out_dir: str, recs_path: str) -> None:
    """Child process of :func:`write_ptx`: the records (JSON list) in ``recs_path``, one ``<variant_key>.ptx`` each."""
    bad = []
    with open(recs_path) as f:
        recs = json.load(f)
    for r in recs:
        try:
            ptx = compile_one(r).asm["ptx"]
            with open(os.path.join(out_dir, variant_key(r) + ".ptx"), "w") as f:
                f.write(ptx)
        except Exception as e:
            bad.append([variant_key(r), repr(e)[-1500:]])
    print("@@" + json.dumps(bad))


def write_ptx(records: list, out_dir: str, timeout_s: float = 7200.0, jobs: int = 1) -> list:
    """Compile every record and its GPU twin (:func:`with_gpu_twins`) for sm_90 in fresh compiled-mode processes
    (``jobs`` of them at once, each taking every ``jobs``-th variant) and write one PTX file per variant,
    ``out_dir/<variant_key>.ptx``, plus ``out_dir/manifest.json`` (key -> record). Returns the failures
    ``[(key, error text)]``. Compare two such folders with :func:`compare_ptx_dirs`."""
    import tempfile

    os.makedirs(out_dir, exist_ok=True)
    recs = with_gpu_twins(records)
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump({variant_key(r): r for r in recs}, f, indent=1, sort_keys=True)
    env = dict(os.environ, TRITON_INTERPRET="0")
    jobs = max(1, jobs)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for j in range(jobs):
            path = os.path.join(tmp, f"job{j}.json")
            with open(path, "w") as f:
                json.dump(recs[j::jobs], f)
            code = ("from tests.support.compile_check import _write_ptx_main\n"
                    f"_write_ptx_main({out_dir!r}, {path!r})\n")
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            line = [ln for ln in out.splitlines() if ln.startswith("@@")]
            failures += [tuple(x) for x in json.loads(line[-1][2:])] if line else [("<process>", err[-3000:])]
    return failures


def normalize_ptx(text: str) -> list:
    """The PTX lines that carry code: drops what only debug info holds (``.loc`` / ``.file`` directives, the
    ``$L__tmp`` / ``$L__func_begin`` / ``$L__func_end`` labels that DWARF ranges point at, the ``.section .debug_*``
    blocks) and comments; white space folded. Everything else (every instruction, register, label and directive)
    is compared as it is."""
    import re

    out, in_debug = [], False
    for raw in text.splitlines():
        line = raw.split("//", 1)[0].strip()
        if in_debug:
            in_debug = line != "}"
            continue
        if line.startswith(".section") and ".debug_" in line:
            in_debug = not line.endswith("}")
            continue
        if not line or line.startswith((".loc", ".file")) or re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", line):
            continue
        out.append(" ".join(line.split()))
    return out


def compare_ptx_dirs(before: str, after: str) -> dict:
    """Compare two :func:`write_ptx` folders variant by variant (:func:`normalize_ptx`).

    Returns ``{"compared": n, "identical": [...], "different": {key: unified diff text}, "only_before": [...],
    "only_after": [...]}``.
    """
    import difflib

    def keys(d):
        return {f[:-4] for f in os.listdir(d) if f.endswith(".ptx")}

    kb, ka = keys(before), keys(after)
    res = {"compared": 0, "identical": [], "different": {}, "only_before": sorted(kb - ka),
           "only_after": sorted(ka - kb)}
    for k in sorted(kb & ka):
        with open(os.path.join(before, k + ".ptx")) as f:
            a = normalize_ptx(f.read())
        with open(os.path.join(after, k + ".ptx")) as f:
            b = normalize_ptx(f.read())
        res["compared"] += 1
        if a == b:
            res["identical"].append(k)
        else:
            res["different"][k] = "\n".join(difflib.unified_diff(a, b, "before/" + k, "after/" + k, lineterm="", n=2))
    return res


def ptxas_usage(rec: dict) -> dict:
    """Registers and spill bytes of one recorded launch compiled for sm_90 (this process must import the kernels
    compiled): the PTX goes through the ptxas bundled with Triton with ``-v``. Returns ``{"name", "registers",
    "spill_stores", "spill_loads"}``; raises FileNotFoundError without a bundled ptxas."""
    import re
    import tempfile

    import triton.backends.nvidia as nv

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise FileNotFoundError(ptxas)
    k = compile_one(rec)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        p = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    text = p.stdout + p.stderr
    num = lambda pat: int(re.search(pat, text).group(1))  # noqa: E731
    return dict(name=rec["name"], registers=num(r"Used (\d+) registers"),
                spill_stores=num(r"(\d+) bytes spill stores"), spill_loads=num(r"(\d+) bytes spill loads"))


def usage_recorded(records: list, timeout_s: float = 600.0) -> list:
    """:func:`ptxas_usage` of every record, in a fresh process (kernels compiled); a record that fails gives
    ``{"name", "error"}``."""
    recs = [r for r in records if "error" not in r]
    code = ("import json,sys\nfrom tests.support.compile_check import ptxas_usage\nout=[]\n"
            "for r in json.loads(sys.stdin.read()):\n    try:\n        out.append(dict(ptxas_usage(r), "
            "constexprs=r['constexprs']))\n    except Exception as e:\n"
            "        out.append(dict(name=r['name'], error=repr(e)[-1500:]))\nprint('@@'+json.dumps(out))\n")
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(recs), capture_output=True, text=True, env=env,
                       timeout=timeout_s)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if not line:
        return [dict(name="<process>", error=p.stderr[-3000:])]
    return json.loads(line[-1][2:])
