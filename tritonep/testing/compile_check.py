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

__all__ = ["record_launches", "compile_recorded", "compile_one", "ptxas_usage", "usage_recorded"]

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


@contextlib.contextmanager
def record_launches(out: list):
    """Record interpreted launches into ``out`` (dicts: module, name, signature, constexprs, options)."""
    from triton.runtime.interpreter import InterpretedFunction

    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            names = self.arg_names
            sig, const = {}, {}
            opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            import inspect

            pyfn = getattr(self.fn, "fn", self.fn)
            ann = {k: p.annotation for k, p in inspect.signature(pyfn).parameters.items()}
            for n in names:
                v = bound.get(n)
                is_const = "constexpr" in str(ann.get(n, "")) or ann.get(n) is __import__("triton").language.constexpr
                if is_const or v is None:
                    sig[n] = "constexpr"
                    const[n] = _const_to_json(v)
                else:
                    sig[n] = _type_of(v)
            rec = dict(module=pyfn.__module__, name=pyfn.__name__, signature=sig, constexprs=const, options=opts)
            importable = getattr(sys.modules.get(pyfn.__module__), pyfn.__name__, None) is not None
            if importable and rec not in out:
                out.append(rec)
        except Exception as e:  # recording must never break the run itself
            out.append({"error": repr(e)})
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield out
    finally:
        InterpretedFunction.run = orig


def _const_to_json(v):
    """A constexpr as JSON: a wire codec (the kernels' ``WIRE``) by its wire name, anything else as it is."""
    from tritonep.kernels.wirecodec import DeviceCodec

    return {"wire_codec": v.name} if isinstance(v, DeviceCodec) else v


def _const_from_json(v):
    """Inverse of :func:`_const_to_json` (the codec from the wire registry)."""
    if isinstance(v, dict) and set(v) == {"wire_codec"}:
        from tritonep.wire import get_wire

        return get_wire(v["wire_codec"]).codec
    return v


def compile_one(rec: dict):
    """Compile one recorded launch for sm_90 in this (non-interpreted) process; returns the compiled kernel."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = importlib.import_module(rec["module"])
    fn = getattr(mod, rec["name"])
    attrs = {}
    for i, n in enumerate(fn.arg_names):
        if rec["signature"][n].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, rec["signature"], {k: _const_from_json(v) for k, v in rec["constexprs"].items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec.get("options") or {})


def compile_recorded(records: list, timeout_s: float = 600.0) -> list:
    """Compile each record in a fresh process (kernels imported in compiled mode); returns failures
    ``[(name, error text)]`` (empty = all compiled)."""
    recs = [r for r in records if "error" not in r]
    for r in list(recs):  # the interpreter runs the poll-count wait; the GPU takes the %globaltimer branch
        if r["constexprs"].get("HAS_TIMER") is False:
            recs.append(dict(r, constexprs=dict(r["constexprs"], HAS_TIMER=True)))
    payload = json.dumps(recs)
    code = ("import json,sys\nfrom tritonep.testing.compile_check import compile_one\nrecs=json.loads(sys.stdin.read())\n"
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
    code = ("import json,sys\nfrom tritonep.testing.compile_check import ptxas_usage\nout=[]\n"
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
