"""Row tiles on the wire: encode a ``[BT, BH]`` tile into wire rows and decode it back (fused into EP kernels).

The kernels take the wire as ONE constexpr argument ``WIRE``: a :class:`DeviceCodec` (what the device needs to
know about a format: block, payload bits, scale bytes and dtype, and the ``@triton.jit`` tile encode/decode
functions). Triton 3.6 treats such an object as a compile-time constant: ``WIRE.block`` folds to an int and
``WIRE.encode(...)`` inlines the format's own tile function, so one generic body serves every format with no
per-format branch (the only branch is raw bf16 vs. quantized). The host-side record of a format
(:class:`tritonep.wire.WireFormat`) holds its codec; a new format = a new codec next to its tile functions.

A wire row of ``hidden`` H holds H * payload_bits / 8 payload bytes, then H / block scales of ``scale_bytes``
each (fp8: H bytes of e4m3, H/128 fp32; mxfp4: H/2 bytes of packed e2m1, H/32 e8m0; bf16: 2H bytes, no scales).
``base`` is a uint8 pointer, ``row_off`` the byte offset of each tile row (a multiple of ``scale_bytes``).
Tile codec contract: ``encode(x fp32 [G, block], POW2, FAST) -> (payload uint8 [G, block*bits/8], scale [G])`` and
``decode(payload, scale, EXACT_MUL, FAST) -> fp32 [G, block]``, bit-exact with the format's torch twin. ``FAST``
(constexpr, True only on the GPU: the kernels pass ``HAS_TIMER``) lets a codec use inline PTX that gives the same
bits more cheaply (:mod:`tritonep.wire.kernels.fp8_hw`); False is the integer path the interpreter runs.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import triton
import triton.language as tl

from ...device.common import cast_rne, widen

__all__ = ["DeviceCodec", "RAW_BF16", "wire_encode", "wire_store_encoded", "wire_store", "wire_load",
           "wire_to", "wire_copy_raw", "wire_load_raw", "wire_store_raw"]


@dataclass(frozen=True, repr=False)
class DeviceCodec:
    """The device side of one wire format, passed to the EP kernels as the ``WIRE`` constexpr.

    Fields: ``name`` (the wire name), ``block`` (elements per scale block; 1 for raw), ``payload_bits`` (bits per
    element on the wire: 16, 8 or 4), ``scale_bytes`` (bytes of one block scale; 0 for raw), ``scale_dtype``
    (``tl`` dtype of a scale, None for raw), ``encode`` / ``decode`` (``@triton.jit`` tile functions, see the module
    docstring; None for raw), ``stage_own`` (the dispatch stages the own rank's rows like a peer's and the expander
    decodes them, instead of the expander encoding them from ``x`` itself: for a codec whose encode costs more in
    the expander than the staging copy it saves; measured on one H100, docs/performance.md). ``repr`` (= ``cache_key``) is stable across processes and names every field (Triton's kernel caches key on
    it: the in-process cache on the repr, so two codecs of one name that differ in any field never share a compiled
    kernel; the tile functions enter by their own source hashes). A codec pickles (and deep-copies) with its tile
    functions named by module and name, found again on load: the copy holds the same functions and has the same
    ``cache_key``; a tile function that is not its module's attribute is refused as pickle refuses it.

    Raises:
        ValueError: inconsistent sizes (a quantized row must fit the 2 bytes per element of the staging rows,
            a block's payload must be a multiple of the scale size, raw must be 16-bit without scales).
    """

    name: str
    block: int
    payload_bits: int
    scale_bytes: int = 0
    scale_dtype: object = None
    encode: object = None
    decode: object = None
    stage_own: bool = False

    def __post_init__(self):
        # the dataclass's own hash (of the fields), computed once: a codec keys every bound launch's variant
        # (tritonep.runtime.launch.Launch), looked up on each call's host path
        object.__setattr__(self, "_hash", hash((self.name, self.block, self.payload_bits, self.scale_bytes,
                                                self.scale_dtype, self.encode, self.decode, self.stage_own)))
        if self.encode is None:
            if (self.block, self.payload_bits, self.scale_bytes) != (1, 16, 0) or self.decode is not None \
                    or self.stage_own:
                raise ValueError(f"codec {self.name!r}: a raw codec is bf16 (block 1, 16 bits, no scales, no decode, "
                                 "own rows not staged)")
            return
        if self.payload_bits not in (4, 8) or self.block % 2 or self.scale_bytes not in (1, 2, 4):
            raise ValueError(f"codec {self.name!r}: payload_bits must be 4 or 8, block even, scale_bytes 1/2/4")
        pb = self.block * self.payload_bits // 8
        if pb % self.scale_bytes or pb + self.scale_bytes > 2 * self.block:
            raise ValueError(f"codec {self.name!r}: block payload {pb} B must be a multiple of scale_bytes "
                             f"{self.scale_bytes} and payload + scale must fit 2 bytes per element")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt through __init__ (its hash made again where it is unpickled, never carried); the tile functions go
        # by where they are found (pickle cannot carry a JIT function itself: its Python function's module attribute
        # is the JIT function, not the function), so the copy holds the same ones and has the same cache_key
        return (_unpickle, (self.name, self.block, self.payload_bits, self.scale_bytes, self.scale_dtype,
                            _tile_ref(self.encode), _tile_ref(self.decode), self.stage_own))

    @property
    def quantized(self) -> bool:
        """True for an encoded format (fp8, mxfp4, ...), False for raw bf16."""
        return self.encode is not None

    @property
    def pay_mul(self) -> int:
        """Payload bytes of n elements = ``n * pay_mul // pay_div`` (exact for the tiles the kernels use)."""
        return max(self.payload_bits // 8, 1)

    @property
    def pay_div(self) -> int:
        """See :attr:`pay_mul`."""
        return max(8 // self.payload_bits, 1)

    @property
    def cache_key(self) -> str:
        """Stable key for Triton's caches: the name, the sizes and the tile functions' source hashes."""
        # interpreted functions (TRITON_INTERPRET=1) have no cache_key: nothing is compiled there
        fns = "-".join(getattr(f, "cache_key", repr(f)) for f in (self.encode, self.decode) if f is not None)
        return (f"wire_{self.name}_{self.block}_{self.payload_bits}_{self.scale_bytes}_{self.scale_dtype}_"
                f"{int(self.stage_own)}_{fns}")

    def __repr__(self) -> str:
        # Triton keys its in-process kernel cache on the string of the specialization (the constexprs' reprs), so
        # the repr names every field that changes the compiled code: two codecs of one name that differ in
        # stage_own (or a size, or a tile function) must not share a compiled kernel
        r = self.__dict__.get("_repr")
        if r is None:
            r = self.cache_key
            object.__setattr__(self, "_repr", r)
        return r


def _tile_ref(f):
    """``(module, name)`` of a tile function (a ``@triton.jit`` function, compiled or interpreted) that is its
    module's attribute of its own name: how a pickled codec finds it again; else ``f`` itself (None, or a function
    defined elsewhere, which pickle then refuses as it would without a reference)."""
    fn = getattr(f, "fn", None)
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if mod is not None and getattr(sys.modules.get(mod), name, None) is f:
        return mod, name
    return f


def _unpickle(name, block, payload_bits, scale_bytes, scale_dtype, encode, decode, stage_own) -> DeviceCodec:
    """The codec :meth:`DeviceCodec.__reduce__` took apart, its tile functions found again (imported where a
    reference names them: the same objects in this process, so the same ``cache_key``)."""
    encode, decode = (getattr(importlib.import_module(f[0]), f[1]) if isinstance(f, tuple) else f
                      for f in (encode, decode))
    return DeviceCodec(name, block, payload_bits, scale_bytes, scale_dtype, encode, decode, stage_own)


RAW_BF16 = DeviceCodec("bf16", block=1, payload_bits=16)
"""The bf16 wire: rows travel as they are (fp32 tiles are rounded to bf16 with RNE first)."""


@triton.jit
def wire_encode(x, BT: tl.constexpr, BH: tl.constexpr, WIRE: tl.constexpr, POW2: tl.constexpr,
                FAST: tl.constexpr = False):
    """Encode a ``[BT, BH]`` tile once: ``(payload, scales)``. Quantized: ``x`` (any float dtype) is widened to
    fp32 and encoded: uint8 ``[BT, BH*bits/8]`` and ``[BT, BH/block]`` scales. Raw: a bf16 tile passes through
    (an fp32 tile is rounded to bf16, RNE) as both. FAST: the codec's GPU-only path (same bits)."""
    if WIRE.quantized:
        G: tl.constexpr = BT * (BH // WIRE.block)
        q, sc = WIRE.encode(tl.reshape(widen(x), (G, WIRE.block)), POW2, FAST)
        return tl.reshape(q, (BT, BH * WIRE.pay_mul // WIRE.pay_div)), tl.reshape(sc, (BT, BH // WIRE.block))
    else:
        if x.dtype == tl.float32:
            xr = cast_rne(x, tl.bfloat16)
            return xr, xr
        else:
            return x, x


@triton.jit
def wire_store_encoded(base, row_off, h0, pay, sc, rmask, H: tl.constexpr, BH: tl.constexpr, WIRE: tl.constexpr):
    """Store an encoded tile (:func:`wire_encode`) into columns [h0, h0+BH) of the wire rows at ``row_off``."""
    if WIRE.quantized:
        hb = h0 * WIRE.pay_mul // WIRE.pay_div + tl.arange(0, BH * WIRE.pay_mul // WIRE.pay_div)
        HB: tl.constexpr = H * WIRE.pay_mul // WIRE.pay_div
        tl.store(base + row_off[:, None] + hb[None, :], pay, mask=rmask[:, None] & (hb < HB)[None, :])
        g = h0 // WIRE.block + tl.arange(0, BH // WIRE.block)
        sp = (base + HB).to(tl.pointer_type(WIRE.scale_dtype))
        tl.store(sp + (row_off // WIRE.scale_bytes)[:, None] + g[None, :], sc,
                 mask=rmask[:, None] & (g < H // WIRE.block)[None, :])
    else:
        h = h0 + tl.arange(0, BH)
        pb = base.to(tl.pointer_type(tl.bfloat16))
        tl.store(pb + (row_off // 2)[:, None] + h[None, :], pay, mask=rmask[:, None] & (h < H)[None, :])


@triton.jit
def wire_store(base, row_off, h0, x, rmask, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr,
               WIRE: tl.constexpr, POW2: tl.constexpr, FAST: tl.constexpr = False):
    """Encode tile ``x`` (bf16 or fp32) into columns [h0, h0+BH) of the wire rows (FAST: see :func:`wire_encode`)."""
    pay, sc = wire_encode(x, BT, BH, WIRE, POW2, FAST)
    wire_store_encoded(base, row_off, h0, pay, sc, rmask, H, BH, WIRE)


@triton.jit
def wire_load(base, row_off, h0, rmask, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WIRE: tl.constexpr,
              EXACT_MUL: tl.constexpr = False, FAST: tl.constexpr = False):
    """Decode columns [h0, h0+BH) of the wire rows: raw bf16 tile for raw, exact fp32 values otherwise (masked
    rows decode to +0.0).

    EXACT_MUL (GPU): a dequant multiply is a standalone ``mul.rn`` so a caller's ``acc += decoded`` is never
    contracted into an FMA (the twins round the product first). FAST (GPU): the codec's inline-PTX decode. A quantized
    wire's payload and scales are loaded by :func:`wire_load_raw`, then decoded."""
    if WIRE.quantized:
        PB: tl.constexpr = WIRE.block * WIRE.pay_mul // WIRE.pay_div  # payload bytes of one block
        q, sc = wire_load_raw(base, row_off, h0, rmask, H, BH, WIRE)
        G: tl.constexpr = BT * (BH // WIRE.block)
        v = WIRE.decode(tl.reshape(q, (G, PB)), tl.reshape(sc, (G,)), EXACT_MUL, FAST)
        return tl.reshape(v, (BT, BH))
    else:
        h = h0 + tl.arange(0, BH)
        pb = base.to(tl.pointer_type(tl.bfloat16))
        return tl.load(pb + (row_off // 2)[:, None] + h[None, :], mask=rmask[:, None] & (h < H)[None, :], other=0.0)


@triton.jit
def wire_to(x, DT: tl.constexpr):
    """A tile from :func:`wire_load` as dtype ``DT``: a raw tile already of ``DT`` as is, else RNE-rounded."""
    if x.dtype == DT:
        return x
    else:
        return cast_rne(x, DT)


@triton.jit
def wire_load_raw(base, row_off, h0, rmask, H: tl.constexpr, BH: tl.constexpr, WIRE: tl.constexpr):
    """The encoded payload (uint8 ``[BT, BH*bits/8]``) and scales (``[BT, BH/block]``) of columns [h0, h0+BH) of the
    wire rows at ``row_off``, not decoded (masked rows read as 0); quantized wires only. Loaded once, stored to
    every route's row by :func:`wire_store_raw`."""
    hb = h0 * WIRE.pay_mul // WIRE.pay_div + tl.arange(0, BH * WIRE.pay_mul // WIRE.pay_div)
    HB: tl.constexpr = H * WIRE.pay_mul // WIRE.pay_div
    q = tl.load(base + row_off[:, None] + hb[None, :], mask=rmask[:, None] & (hb < HB)[None, :], other=0)
    g = h0 // WIRE.block + tl.arange(0, BH // WIRE.block)
    sp = (base + HB).to(tl.pointer_type(WIRE.scale_dtype))
    sc = tl.load(sp + (row_off // WIRE.scale_bytes)[:, None] + g[None, :],
                 mask=rmask[:, None] & (g < H // WIRE.block)[None, :], other=0)
    return q, sc


@triton.jit
def wire_store_raw(q, sc, h0, q_ptr, s_ptr, dst_rows, dmask, H: tl.constexpr, BH: tl.constexpr, WIRE: tl.constexpr):
    """Store a tile from :func:`wire_load_raw` to rows ``dst_rows`` (``dmask``) of ``q_ptr`` (uint8
    ``[R, H*bits/8]``) and ``s_ptr`` (``[R, H/block]`` scales)."""
    hb = h0 * WIRE.pay_mul // WIRE.pay_div + tl.arange(0, BH * WIRE.pay_mul // WIRE.pay_div)
    HB: tl.constexpr = H * WIRE.pay_mul // WIRE.pay_div
    tl.store(q_ptr + dst_rows[:, None].to(tl.int64) * HB + hb[None, :], q, mask=dmask[:, None] & (hb < HB)[None, :])
    g = h0 // WIRE.block + tl.arange(0, BH // WIRE.block)
    tl.store(s_ptr + dst_rows[:, None].to(tl.int64) * (H // WIRE.block) + g[None, :], sc,
             mask=dmask[:, None] & (g < H // WIRE.block)[None, :])


@triton.jit
def wire_copy_raw(base, row_off, h0, rmask, q_ptr, s_ptr, dst_rows, dmask, H: tl.constexpr, BH: tl.constexpr,
                  WIRE: tl.constexpr):
    """Copy the encoded payload and scales of columns [h0, h0+BH) of the wire rows to rows ``dst_rows`` of
    ``q_ptr`` (uint8 ``[R, H*bits/8]``) and ``s_ptr`` (``[R, H/block]`` scales); nothing for raw."""
    if WIRE.quantized:
        q, sc = wire_load_raw(base, row_off, h0, rmask, H, BH, WIRE)
        wire_store_raw(q, sc, h0, q_ptr, s_ptr, dst_rows, dmask, H, BH, WIRE)
