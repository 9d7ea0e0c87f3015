"""Row tiles on the wire: encode a ``[BT, BH]`` tile into wire rows and decode it back (fused into EP kernels).

A wire row of ``hidden`` H is ``row_bytes`` bytes (:func:`row_bytes`): bf16: 2H bytes of bf16; fp8: H bytes of
e4m3 then H/128 fp32 scales; mxfp4: H/2 bytes of packed e2m1 then H/32 e8m0 bytes. ``base`` is a uint8 pointer,
``row_off`` the byte offset of each tile row. WIRE: 0 bf16, 1 fp8, 2 mxfp4. The quantizers are the bit-exact
device functions of :mod:`tritonep.kernels.quant` (twins in :mod:`tritonep.wire`).
"""

import triton
import triton.language as tl

from .quant import fp8_dequant_tile, fp8_quant_tile, mxfp4_dequant_tile, mxfp4_quant_tile

WIRE_IDS = {"bf16": 0, "fp8": 1, "mxfp4": 2}


def row_bytes(wire: str, hidden: int) -> int:
    """Bytes of one wire row (payload + scales), a multiple of 16 for the hidden sizes the wire accepts."""
    if wire == "bf16":
        return 2 * hidden
    if wire == "fp8":
        return hidden + 4 * (hidden // 128)
    return hidden // 2 + hidden // 32


@triton.jit
def wire_encode(x, BT: tl.constexpr, BH: tl.constexpr, WIRE: tl.constexpr, POW2: tl.constexpr):
    """Quantize a ``[BT, BH]`` fp32 tile once: ``(payload, scales)`` (fp8: uint8 [BT, BH], fp32 [BT, BH/128];
    mxfp4: uint8 [BT, BH/2], uint8 [BT, BH/32]); WIRE 0 passes the raw bf16 tile through as both."""
    if WIRE == 1:
        G: tl.constexpr = BT * (BH // 128)
        q, sc = fp8_quant_tile(tl.reshape(x, (G, 128)), POW2)
        return tl.reshape(q, (BT, BH)), tl.reshape(sc, (BT, BH // 128))
    elif WIRE == 2:
        G2: tl.constexpr = BT * (BH // 32)
        pk, e8 = mxfp4_quant_tile(tl.reshape(x, (G2, 32)))
        return tl.reshape(pk, (BT, BH // 2)), tl.reshape(e8, (BT, BH // 32))
    else:
        return x, x


@triton.jit
def wire_store_encoded(base, row_off, h0, pay, sc, rmask, H: tl.constexpr, BH: tl.constexpr, WIRE: tl.constexpr):
    """Store an encoded tile (:func:`wire_encode`) into columns [h0, h0+BH) of the wire rows at ``row_off``."""
    h = h0 + tl.arange(0, BH)
    if WIRE == 0:
        pb = base.to(tl.pointer_type(tl.bfloat16))
        tl.store(pb + (row_off // 2)[:, None] + h[None, :], pay, mask=rmask[:, None] & (h < H)[None, :])
    elif WIRE == 1:
        tl.store(base + row_off[:, None] + h[None, :], pay, mask=rmask[:, None] & (h < H)[None, :])
        g = h0 // 128 + tl.arange(0, BH // 128)
        sp = (base + H).to(tl.pointer_type(tl.float32))
        tl.store(sp + (row_off // 4)[:, None] + g[None, :], sc, mask=rmask[:, None] & (g < H // 128)[None, :])
    else:
        hb = h0 // 2 + tl.arange(0, BH // 2)
        tl.store(base + row_off[:, None] + hb[None, :], pay, mask=rmask[:, None] & (hb < H // 2)[None, :])
        g2 = h0 // 32 + tl.arange(0, BH // 32)
        tl.store(base + H // 2 + row_off[:, None] + g2[None, :], sc, mask=rmask[:, None] & (g2 < H // 32)[None, :])


@triton.jit
def wire_store(base, row_off, h0, x, rmask, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr,
               WIRE: tl.constexpr, POW2: tl.constexpr):
    """Encode tile ``x`` (bf16 raw for WIRE 0, fp32 otherwise) into columns [h0, h0+BH) of the wire rows."""
    pay, sc = wire_encode(x, BT, BH, WIRE, POW2)
    wire_store_encoded(base, row_off, h0, pay, sc, rmask, H, BH, WIRE)


@triton.jit
def wire_load(base, row_off, h0, rmask, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WIRE: tl.constexpr,
              EXACT_MUL: tl.constexpr = False):
    """Decode columns [h0, h0+BH) of the wire rows: raw bf16 tile for WIRE 0, exact fp32 values otherwise.

    EXACT_MUL (GPU): the fp8 dequant multiply is a standalone ``mul.rn`` so a caller's ``acc += decoded`` is never
    contracted into an FMA (the twins round the product first)."""
    h = h0 + tl.arange(0, BH)
    if WIRE == 0:
        pb = base.to(tl.pointer_type(tl.bfloat16))
        return tl.load(pb + (row_off // 2)[:, None] + h[None, :], mask=rmask[:, None] & (h < H)[None, :], other=0.0)
    elif WIRE == 1:
        q = tl.load(base + row_off[:, None] + h[None, :], mask=rmask[:, None] & (h < H)[None, :], other=0)
        g = h0 // 128 + tl.arange(0, BH // 128)
        sp = (base + H).to(tl.pointer_type(tl.float32))
        sc = tl.load(sp + (row_off // 4)[:, None] + g[None, :], mask=rmask[:, None] & (g < H // 128)[None, :],
                     other=1.0)
        G: tl.constexpr = BT * (BH // 128)
        v = fp8_dequant_tile(tl.reshape(q, (G, 128)), tl.reshape(sc, (G,)), EXACT_MUL)
        return tl.reshape(v, (BT, BH))
    else:
        hb = h0 // 2 + tl.arange(0, BH // 2)
        pk = tl.load(base + row_off[:, None] + hb[None, :], mask=rmask[:, None] & (hb < H // 2)[None, :], other=0)
        g2 = h0 // 32 + tl.arange(0, BH // 32)
        e8 = tl.load(base + H // 2 + row_off[:, None] + g2[None, :], mask=rmask[:, None] & (g2 < H // 32)[None, :],
                     other=127)
        G2: tl.constexpr = BT * (BH // 32)
        v = mxfp4_dequant_tile(tl.reshape(pk, (G2, 16)), tl.reshape(e8, (G2,)))
        return tl.reshape(v, (BT, BH))


@triton.jit
def wire_copy_raw(base, row_off, h0, rmask, q_ptr, s_ptr, dst_rows, dmask, H: tl.constexpr, BH: tl.constexpr,
                  WIRE: tl.constexpr):
    """Copy the quantized payload and scales of columns [h0, h0+BH) of the wire rows to ``q_ptr`` rows
    ``dst_rows`` (fp8: [R, H] bytes, [R, H/128] fp32 scales; mxfp4: [R, H/2] bytes, [R, H/32] e8m0)."""
    if WIRE == 1:
        h = h0 + tl.arange(0, BH)
        q = tl.load(base + row_off[:, None] + h[None, :], mask=rmask[:, None] & (h < H)[None, :], other=0)
        tl.store(q_ptr + dst_rows[:, None].to(tl.int64) * H + h[None, :], q, mask=dmask[:, None] & (h < H)[None, :])
        g = h0 // 128 + tl.arange(0, BH // 128)
        sp = (base + H).to(tl.pointer_type(tl.float32))
        gm = (g < H // 128)[None, :]
        sc = tl.load(sp + (row_off // 4)[:, None] + g[None, :], mask=rmask[:, None] & gm, other=0.0)
        tl.store(s_ptr + dst_rows[:, None].to(tl.int64) * (H // 128) + g[None, :], sc, mask=dmask[:, None] & gm)
    elif WIRE == 2:
        hb = h0 // 2 + tl.arange(0, BH // 2)
        hm = (hb < H // 2)[None, :]
        pk = tl.load(base + row_off[:, None] + hb[None, :], mask=rmask[:, None] & hm, other=0)
        tl.store(q_ptr + dst_rows[:, None].to(tl.int64) * (H // 2) + hb[None, :], pk, mask=dmask[:, None] & hm)
        g2 = h0 // 32 + tl.arange(0, BH // 32)
        gm2 = (g2 < H // 32)[None, :]
        e8 = tl.load(base + H // 2 + row_off[:, None] + g2[None, :], mask=rmask[:, None] & gm2, other=0)
        tl.store(s_ptr + dst_rows[:, None].to(tl.int64) * (H // 32) + g2[None, :], e8, mask=dmask[:, None] & gm2)
