"""Packed launches: a compiled kernel variant's parameters laid out once, a launch passes only its per-call values.

Triton 3.6's C launcher takes every argument of a kernel at every launch (runtime ones and constexprs alike, parsed
by ``PyArg_ParseTuple``): on the H200 host ~0.12 us per argument, 11.6 us for the 68 of the one-launch decode
dispatch against 7.9 us for the 38 of the decode combine (``benchmarks/eager_profile.py``).
A :func:`bind` packs the parameter storage of one compiled variant ONCE (static device addresses, tiles, ranks,
the zero scratch pointers) and the launch (``_tritonep_launch.run``, a ``METH_FASTCALL`` C function) stores only
the per-call values (input addresses, T, the call's storage block) into their slots and calls ``cuLaunchKernelEx``
with the variant's grid, warps and shared memory: the argument count of a launch no longer grows with the kernel's.

The C module (``packed_launch.c``) is built once per machine with Triton's own builder
(``triton.runtime.build.compile_module_from_src``: the C compiler Triton uses for its launchers, its cache
directory, Triton's ``cuda.h``) and opens the CUDA driver itself (``dlopen``), so it builds and packs on a machine
without a GPU (the tests compare its bytes with :func:`pack_twin`). Where it cannot be built the callers keep
Triton's own launcher (:func:`module` returns None and :func:`build_error` says why).

Layout (the spec, :func:`pack_twin`): the kernel's parameters are the signature's non-constexpr entries in order,
then Triton's two scratch pointers (global, profile; 0: :class:`tritonep.runtime.bound.BoundKernel` binds no variant
that needs scratch); each at an 8-byte-aligned offset, stored as its C type (pointers uint64, ``i32`` int32, ...,
``fp32`` as float32 bits, ``fp64`` double), as Triton's launcher passes them. Supported types: pointers, ``i1`` /
``i8`` ... ``u64``, ``fp32`` / ``f32``, ``fp64``; a variant with another type (tuples, tensor descriptors, fp16 /
bf16 scalars) or clusters (``num_ctas > 1``) is not packed (:func:`bind` returns None: Triton's launcher).

Idea: the per-variant argument block of a CUDA graph kernel node (parameters stored once, only the changed ones
rewritten), applied to eager launches; vLLM's ``CachedKernel`` bypasses Triton's Python binder the same way, this
also bypasses its per-launch argument parsing.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

__all__ = ["module", "build_error", "kind_of", "layout", "pack_twin", "bind", "KINDS"]

KINDS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "B", "u8": "B", "u16": "H", "u32": "I",
         "u64": "L", "fp32": "f", "f32": "f", "fp64": "d"}
"""Triton signature type -> the C module's kind letter (pointers ``*T`` are ``p``, constexprs ``x``)."""

_FMT = {"p": "<Q", "b": "<b", "B": "<B", "h": "<h", "H": "<H", "i": "<i", "I": "<I", "l": "<q", "L": "<Q",
        "f": "<f", "d": "<d"}
_SCRATCH = 2  # Triton 3.6 appends the global and the profile scratch pointer to every kernel's parameters

_MOD = None
_ERR: str | None = None


def module():
    """The built C module (``run``, ``run_grid``, ``fill``, ``make``), or None when it cannot be built here (no C
    compiler, no Python headers): :func:`build_error` then holds the reason. Built once per process (Triton's cache
    keeps the binary per machine)."""
    global _MOD, _ERR
    if _MOD is None and _ERR is None:
        try:
            import triton
            from triton.runtime.build import compile_module_from_src

            inc = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
            src = (Path(__file__).parent / "packed_launch.c").read_text()
            _MOD = compile_module_from_src(src, "_tritonep_launch", include_dirs=[str(inc)], libraries=["dl"])
        except Exception as e:  # noqa: BLE001 - any build failure leaves Triton's launcher in place
            _ERR = f"{type(e).__name__}: {e}"
    return _MOD


def build_error() -> str | None:
    """Why :func:`module` returned None (None when it was built or not tried yet)."""
    return _ERR


def kind_of(ty) -> str | None:
    """The kind letter of one signature type (``"x"`` for a constexpr), or None when packing does not support it."""
    if not isinstance(ty, str):
        return None  # a tuple argument
    if ty == "constexpr":
        return "x"
    if ty.startswith("*"):
        return "p"
    return KINDS.get(ty)


def layout(types) -> tuple | None:
    """``(offsets, nbytes)`` of a signature (its types in parameter order): ``offsets[i]`` is the byte offset of
    parameter ``i`` (None for a constexpr), then the two scratch pointers' offsets; or None when a type is not
    supported."""
    offsets, off = [], 0
    for ty in types:
        k = kind_of(ty)
        if k is None:
            return None
        if k == "x":
            offsets.append(None)
            continue
        offsets.append(off)
        off += 8  # every slot 8-byte aligned (at most 8 bytes each)
    for _ in range(_SCRATCH):
        offsets.append(off)
        off += 8
    return offsets, off


def _pack_one(buf: bytearray, off: int, k: str, v):
    if k == "p":
        v = 0 if v is None else v
    elif k == "f":
        v = float(v)
        try:
            struct.pack("<f", v)
        except OverflowError:  # beyond float32: the C cast gives an infinity, as Triton's pack_fp32 does
            v = math.copysign(math.inf, v)
    elif k == "d":
        v = float(v)
    else:
        v = int(v)  # a bool is an int
    struct.pack_into(_FMT[k], buf, off, v)


def pack_twin(types, values) -> bytes:
    """The parameter storage a launch of a variant with signature ``types`` and argument ``values`` (one per
    signature entry, constexprs included and ignored; device addresses as ints or None) must hand the driver: the
    spec of the C module's ``fill`` (module docstring)."""
    lay = layout(types)
    if lay is None:
        raise TypeError(f"unsupported signature {types}")
    offsets, n = lay
    buf = bytearray(n)
    for ty, off, v in zip(types, offsets, values):
        if off is not None:
            _pack_one(buf, off, kind_of(ty), v)
    return bytes(buf)


def bind(compiled, static: dict, call_pos: tuple, grid3: tuple | None):
    """One compiled variant bound for packed launches: a capsule for ``module().run(cap, stream, *values)`` (or
    ``run_grid(cap, gx, gy, gz, stream, *values)`` when ``grid3`` is None), or None when the variant cannot be
    packed (module docstring) or the module is not built.

    Args:
        compiled: Triton's ``CompiledKernel`` (``src.signature``, ``metadata``, ``function`` loaded).
        static: parameter position -> value for every parameter a call does not pass (device addresses as ints).
        call_pos: the positions of the values a call passes, in the order it passes them.
        grid3: the bound grid (three ints) or None (per-call).
    """
    mod = module()
    src = getattr(compiled, "src", None)
    sig = getattr(src, "signature", None)
    md = getattr(compiled, "metadata", None)
    function = getattr(compiled, "function", None)
    if mod is None or not isinstance(sig, dict) or md is None or not function:
        return None
    types = list(sig.values())
    lay = layout(types)
    if lay is None or getattr(md, "num_ctas", 1) != 1:
        return None
    offsets, n = lay
    buf = bytearray(n)
    for pos, v in static.items():
        off = offsets[pos]
        if off is not None:
            _pack_one(buf, off, kind_of(types[pos]), v)
    kinds = "".join(kind_of(types[p]) for p in call_pos)
    dyn_off = tuple(-1 if offsets[p] is None else offsets[p] for p in call_pos)
    kernel_offsets = tuple(o for o in offsets if o is not None)
    gx, gy, gz = grid3 if grid3 is not None else (-1, -1, -1)  # -1: no bound grid (run_grid); 0: an empty grid
    coop = int(bool(getattr(md, "launch_cooperative_grid", False)))
    pdl = int(bool(getattr(md, "launch_pdl", False)))
    return mod.make(int(function), int(gx), int(gy), int(gz), int(md.num_warps), 1, int(md.shared), coop, pdl,
                    bytes(buf), kernel_offsets, kinds.encode(), dyn_off)
