"""Standalone row quantize / dequantize kernels of the scaled wires (``tritonep.wire.quantize_fp8`` & co.).

Host wrappers, specs and torch twins: :mod:`tritonep.wire.fp8` (fp8 e4m3 and the other fp32-scaled 8-bit codecs,
e.g. e5m2) and :mod:`tritonep.wire.mxfp4`. The tile codecs they call live in :mod:`tritonep.wire.kernels.quant`.
"""

import triton
import triton.language as tl

from .quant import load_as_fp32, mxfp4_dequant_tile, mxfp4_quant_tile, store_fp32_as

__all__ = ["fp8_quant_kernel", "fp8_dequant_kernel", "mxfp4_quant_kernel", "mxfp4_dequant_kernel"]


@triton.jit
def fp8_quant_kernel(x_ptr, q_ptr, s_ptr, N, H, KIND: tl.constexpr, POW2: tl.constexpr,
                      R: tl.constexpr, G: tl.constexpr, BLK: tl.constexpr, CODEC: tl.constexpr,
                      FAST: tl.constexpr = False):
    """Programs over blocks of R rows; each walks its rows' scale blocks G at a time (tile [R*G, BLK]).
    CODEC: an 8-bit fp32-scaled :class:`tritonep.wire.kernels.wirecodec.DeviceCodec` (e4m3, e5m2); FAST: its GPU-only
    inline-PTX path (same bits)."""
    pid = tl.program_id(0)
    nb = H // BLK
    t = tl.arange(0, R * G)
    col = tl.arange(0, BLK)
    for r0 in range(pid * R, N, tl.num_programs(0) * R):
        row = (r0 + t // G).to(tl.int64)
        for g0 in range(0, nb, G):
            g = g0 + t % G
            ok = (row < N) & (g < nb)
            offs = row[:, None] * H + g[:, None] * BLK + col[None, :]
            x = load_as_fp32(x_ptr, offs, ok[:, None], KIND)
            q, s = CODEC.encode(x, POW2, FAST)
            tl.store(q_ptr + offs, q, mask=ok[:, None])
            tl.store(s_ptr + row * nb + g, s, mask=ok)


@triton.jit
def fp8_dequant_kernel(q_ptr, s_ptr, o_ptr, N, H, KIND: tl.constexpr,
                        R: tl.constexpr, G: tl.constexpr, BLK: tl.constexpr, CODEC: tl.constexpr,
                        FAST: tl.constexpr = False):
    """Inverse of :func:`fp8_quant_kernel` with the same tiling."""
    # the block walk of fp8_quant_kernel, kept inline: every load and store differs (a walker would take the body)
    pid = tl.program_id(0)
    nb = H // BLK
    t = tl.arange(0, R * G)
    col = tl.arange(0, BLK)
    for r0 in range(pid * R, N, tl.num_programs(0) * R):
        row = (r0 + t // G).to(tl.int64)
        for g0 in range(0, nb, G):
            g = g0 + t % G
            ok = (row < N) & (g < nb)
            offs = row[:, None] * H + g[:, None] * BLK + col[None, :]
            q = tl.load(q_ptr + offs, mask=ok[:, None], other=0)
            s = tl.load(s_ptr + row * nb + g, mask=ok, other=1.0)
            # EXACT_MUL on the GPU (= FAST): ``mul.rn.f32`` keeps subnormal products, which a plain multiply may
            # flush to zero (the first GPU run of tests/wire/test_fp8_hw_gpu.py caught it at scale 2^-126)
            store_fp32_as(o_ptr, offs, CODEC.decode(q, s, FAST, FAST), ok[:, None], KIND)


@triton.jit
def mxfp4_quant_kernel(x_ptr, p_ptr, s_ptr, N, H, KIND: tl.constexpr, R: tl.constexpr, G: tl.constexpr):
    """Programs over blocks of R rows; each walks its rows' 32-element blocks G at a time (tile [R*G, 32])."""
    pid = tl.program_id(0)
    nb = H // 32
    t = tl.arange(0, R * G)
    col = tl.arange(0, 32)
    pcol = tl.arange(0, 16)
    for r0 in range(pid * R, N, tl.num_programs(0) * R):
        row = (r0 + t // G).to(tl.int64)
        for g0 in range(0, nb, G):
            g = g0 + t % G
            ok = (row < N) & (g < nb)
            x = load_as_fp32(x_ptr, row[:, None] * H + g[:, None] * 32 + col[None, :], ok[:, None], KIND)
            packed, e8 = mxfp4_quant_tile(x)
            tl.store(p_ptr + row[:, None] * (H // 2) + g[:, None] * 16 + pcol[None, :], packed, mask=ok[:, None])
            tl.store(s_ptr + row * nb + g, e8, mask=ok)


@triton.jit
def mxfp4_dequant_kernel(p_ptr, s_ptr, o_ptr, N, H, KIND: tl.constexpr, R: tl.constexpr, G: tl.constexpr):
    """Inverse of :func:`mxfp4_quant_kernel` with the same tiling."""
    # the block walk of mxfp4_quant_kernel, kept inline: every load and store differs (a walker would take the body)
    pid = tl.program_id(0)
    nb = H // 32
    t = tl.arange(0, R * G)
    col = tl.arange(0, 32)
    pcol = tl.arange(0, 16)
    for r0 in range(pid * R, N, tl.num_programs(0) * R):
        row = (r0 + t // G).to(tl.int64)
        for g0 in range(0, nb, G):
            g = g0 + t % G
            ok = (row < N) & (g < nb)
            packed = tl.load(p_ptr + row[:, None] * (H // 2) + g[:, None] * 16 + pcol[None, :], mask=ok[:, None],
                             other=0)
            e8 = tl.load(s_ptr + row * nb + g, mask=ok, other=127)
            v = mxfp4_dequant_tile(packed, e8)
            store_fp32_as(o_ptr, row[:, None] * H + g[:, None] * 32 + col[None, :], v, ok[:, None], KIND)
