"""The compiled-kernel variants a run needs, keyed exactly as Triton's JIT cache keys them, per rank.

Triton compiles one variant per distinct *specialisation* of a launch: the value of every ``tl.constexpr``, the
dtype and 16-byte alignment of every tensor, and for every int not listed in ``do_not_specialize`` whether it is 1
(then a constant), a multiple of 16 (``tt.divisibility``) or neither, plus the compile options (``num_warps``, ...).
:func:`launch_key` computes that key for an interpreted launch with Triton's own binder
(``create_function_from_signature`` over the kernel's ``KernelParam`` list, ``native_specialize_impl``), so what a
CPU run records is what a GPU run of the same code would compile. (:mod:`tests.support.compile_check` records
argument types only: enough to compile every kernel, not to tell which launches share a variant.)

:func:`record_keys_to` records the key of every launch of a CPU world, with the rank that launched it; with
:func:`variants_by_rank` and :func:`count` a test or script sees how many variants each rank compiles, how many
distinct ones the ranks need together, and whether two ranks compile different variants of the same launch (a
rank-dependent constexpr or specialised int: ``tests/backends/test_rank_variants.py``). :func:`compile_key`
compiles one key for sm_90 (constexprs, int constants and divisibility hints as the GPU JIT would pass them).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

__all__ = ["launch_key", "record_keys_to", "read_keys", "variants_by_rank", "count", "compile_key", "key_text",
           "compiled_keys"]

_BINDERS: dict = {}


def _json_const(v):
    from tests.support.compile_check import _const_to_json

    v = getattr(v, "value", v) if type(v).__name__ == "constexpr" else v
    v = _const_to_json(v)
    if v is None or isinstance(v, (bool, int, float, str, dict)):
        return v
    if isinstance(v, (tuple, list)):
        return [_json_const(x) for x in v]
    return repr(v)


def _binder(jitfn):
    """Triton's own argument binder for ``jitfn`` (interpreted or compiled), built once per kernel."""
    b = _BINDERS.get(id(jitfn))
    if b is None:
        import inspect

        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import KernelParam, create_function_from_signature

        pyfn = getattr(jitfn.fn, "fn", jitfn.fn)
        kw = getattr(jitfn, "kwargs", None) or {}
        dns = kw.get("do_not_specialize", getattr(jitfn, "do_not_specialize", None)) or []
        dnsa = kw.get("do_not_specialize_on_alignment", getattr(jitfn, "do_not_specialize_on_alignment", None)) or []
        sig = inspect.signature(pyfn)
        params = [KernelParam(i, p, i in dns or p.name in dns, i in dnsa or p.name in dnsa)
                  for i, p in enumerate(sig.parameters.values())]
        b = _BINDERS[id(jitfn)] = (pyfn, [p.name for p in params],
                                   create_function_from_signature(sig, params, BaseBackend))
    return b


def launch_key(jitfn, args, kwargs) -> dict:
    """Triton's cache key of one launch ``jitfn[grid](*args, **kwargs)``, JSON-able: ``{"module", "name",
    "spec": {param: [type, specialisation]}, "options": {...}}`` (a constexpr's specialisation is its value, for
    a wire codec its name and fields (``compile_check._const_to_json``); an int's is ``"D"`` (multiple of 16),
    ``""`` or None (not specialised), or the parameter is ``["constexpr", 1]``; a tensor's ``"D"`` when 16-byte
    aligned)."""
    pyfn, names, bind = _binder(jitfn)
    _, spec, opts = bind(*args, **kwargs)
    out = {}
    for n, (ty, val) in zip(names, spec):
        out[n] = [ty, _json_const(val) if ty == "constexpr" else val]
    opts = {k: _json_const(v) for k, v in opts.items()}
    return dict(module=pyfn.__module__, name=pyfn.__name__, spec=out, options=opts)


def key_text(key: dict) -> str:
    """The canonical text of a key (sorted JSON): equal texts are one compiled variant."""
    return json.dumps({k: key[k] for k in ("module", "name", "spec", "options")}, sort_keys=True)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


@contextlib.contextmanager
def record_keys_to(path: str):
    """Append ``{"rank", "key"}`` (JSON lines) for every distinct (rank, key) of the interpreted launches made
    while the context is open, in this process and every process forked inside it (a CPU world's ranks: one
    ``O_APPEND`` write per record). Read back with :func:`read_keys`."""
    from triton.runtime.interpreter import InterpretedFunction

    orig = InterpretedFunction.run
    seen = set()

    def run(self, *args, grid, warmup, **kwargs):
        try:
            key = launch_key(self, args, kwargs)
            line = json.dumps(dict(rank=_rank(), key=key), sort_keys=True)
        except Exception as e:  # recording must never break the run itself
            line = json.dumps(dict(rank=_rank(), error=repr(e)))
        if line not in seen:
            seen.add(line)
            from tests.support.compile_check import append_line

            append_line(path, line)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield path
    finally:
        InterpretedFunction.run = orig


def read_keys(path: str) -> list:
    """The records of a :func:`record_keys_to` file (dicts ``rank`` + ``key`` or ``error``)."""
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def variants_by_rank(records: list) -> dict:
    """rank -> {key text -> key}: the distinct variants each rank launched (:func:`key_text`). Raises
    AssertionError when a launch could not be keyed."""
    errors = [r for r in records if "error" in r]
    assert not errors, errors[:3]
    out: dict = {}
    for r in records:
        out.setdefault(r["rank"], {})[key_text(r["key"])] = r["key"]
    return out


def count(records: list) -> dict:
    """``{"per_rank": {rank: n}, "sum": sum of the per-rank counts, "distinct": the variants all ranks need
    together, "by_kernel": {name: distinct variants}}``."""
    by = variants_by_rank(records)
    union: dict = {}
    for v in by.values():
        union.update(v)
    kern: dict = {}
    for k in union.values():
        kern[k["name"]] = kern.get(k["name"], 0) + 1
    return dict(per_rank={r: len(v) for r, v in sorted(by.items())}, sum=sum(len(v) for v in by.values()),
                distinct=len(union), by_kernel=dict(sorted(kern.items())))


def compile_key(key: dict):
    """Compile one :func:`launch_key` for sm_90 in this process (kernels imported compiled: ``TRITON_INTERPRET=0``)
    as the GPU JIT would: constexprs and ints specialised to 1 as constants, ``"D"`` as ``tt.divisibility`` 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.support.compile_check import _const_from_json, kernel_of

    fn = kernel_of(key)
    sig, const, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        ty, val = key["spec"][n]
        sig[n] = ty
        if ty == "constexpr":
            const[n] = _const_from_json(val)
        elif val == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {k: v for k, v in key["options"].items() if k in ("num_warps", "num_stages", "num_ctas", "maxnreg")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def _compile_main() -> None:
    """Child process of :func:`compile_keys`: keys (JSON list) on stdin; prints ``@@`` + JSON of per-key seconds
    and failures."""
    import time

    keys = json.loads(sys.stdin.read())
    secs, bad = [], []
    for k in keys:
        t0 = time.perf_counter()
        try:
            compile_key(k)
        except Exception as e:  # noqa: BLE001 - reported
            bad.append([k["name"], repr(e)[-1500:]])
        secs.append(time.perf_counter() - t0)
    print("@@" + json.dumps(dict(seconds=secs, failures=bad)))


def compile_keys(keys: list, timeout_s: float = 3600.0, cache_dir: str | None = None) -> dict:
    """Compile ``keys`` for sm_90 in one fresh compiled-mode process with an empty Triton cache (``cache_dir``, a
    new temporary folder by default); returns ``{"seconds": [per key], "failures": [[name, error]]}``."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=cache_dir or tmp)
        code = "from tests.support.variant_keys import _compile_main\n_compile_main()\n"
        p = subprocess.run([sys.executable, "-c", code], input=json.dumps(keys), capture_output=True, text=True,
                           env=env, timeout=timeout_s)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if not line:
        return dict(seconds=[], failures=[["<process>", p.stderr[-3000:]]])
    return json.loads(line[-1][2:])


def compiled_keys(device_index: int) -> dict:
    """On a GPU process: ``{kernel: sorted cache keys}`` of every variant Triton's JIT compiled (or loaded) on device
    ``device_index`` so far, over every @triton.jit of tritonep's kernel modules (``JITFunction.device_caches``): what
    two ranks compare to see that they run one variant set."""
    import importlib
    import pkgutil

    import tritonep

    out = {}
    for m in pkgutil.walk_packages(tritonep.__path__, "tritonep."):
        if ".kernels." not in m.name and not m.name.startswith("tritonep.device."):
            continue
        mod = importlib.import_module(m.name)
        for name, obj in vars(mod).items():
            caches = getattr(obj, "device_caches", None)
            if caches is None or getattr(getattr(obj, "fn", None), "__module__", None) != mod.__name__:
                continue
            if device_index in caches and caches[device_index][0]:
                out[f"{mod.__name__}.{name}"] = sorted(str(k) for k in caches[device_index][0])
    return out
