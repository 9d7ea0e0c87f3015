"""Small device helpers shared by the kernels, the row-tile bundle the EP helpers take, and the check that the kernels
were built for the device in use."""

from collections import namedtuple

import triton
import triton.language as tl


RowTile = namedtuple("RowTile", "K KB H BH BT RB WIRE HAS_TIMER")
RowTile.__doc__ = """The static shape of the row tiles an EP data-movement helper moves
    (:mod:`tritonep.backends.triton.kernels.dispatch`, :mod:`tritonep.backends.triton.kernels.combine`), bound once in a kernel from its own constexpr
    parameters and handed whole to the helpers:
    ``tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)``.

    Every field is a compile-time constant and the bundle is one too (bind it with the ``tl.constexpr`` annotation: a
    plain assignment would turn its fields into tensors); a helper reads ``tile.BT``, ``tile.WIRE.quantized``, ... as
    constants. The generated code is the same as with loose arguments (``scripts/ptx_snapshot.py`` compares the PTX).
    The runtime values a helper needs travel in its own named tuple of pointers (e.g.
    :class:`tritonep.backends.triton.kernels.dispatch.ExpandIO`), the rank among them: the rank is a runtime kernel
    argument (``do_not_specialize``), so the ranks of a world share one compiled variant of every kernel.

    Fields: ``K`` (top-k), ``KB`` (power of two >= K), ``H`` (hidden), ``BH`` (hidden tile), ``BT`` (token
    tile), ``RB`` (bytes of one wire row), ``WIRE`` (:class:`tritonep.wire.kernels.wirecodec.DeviceCodec`), ``HAS_TIMER``
    (True exactly on the GPU: the ``%globaltimer`` waits, and the codecs' FAST / exact-multiply paths)."""


@triton.jit
def chunk_index(c, n, tile, live=None):
    """Index vectors of token chunk ``c`` (tokens ``[c*BT, c*BT+BT)``) of a source with ``n`` tokens, for the
    :class:`RowTile` ``tile``: ``t`` [BT] token ids, ``k_off`` [KB] and ``h_off`` [BH] offsets, ``tm`` [BT] (``t <
    n``, and ``live`` when given) and ``m2`` [BT, KB] (the (token, k) slots that exist)."""
    t_off = tl.arange(0, tile.BT)
    k_off = tl.arange(0, tile.KB)
    h_off = tl.arange(0, tile.BH)
    t = c * tile.BT + t_off
    tm = t < n
    if live is not None:
        tm = tm & live
    m2 = tm[:, None] & (k_off[None, :] < tile.K)
    return t, k_off, h_off, tm, m2


def kernels_interpreted() -> bool:
    """True when this process's kernel modules were decorated for Triton's CPU interpreter.

    Triton chooses compiled (``JITFunction``) or interpreted (``InterpretedFunction``) kernels when a kernel module
    is first imported, from ``TRITON_INTERPRET``; this reads what was chosen (the kernel objects), not the variable.
    """
    return type(cast_rne).__name__ == "InterpretedFunction"


def check_kernel_mode(device_type: str) -> None:
    """Refuse a device the kernels were not built for, before anything is launched.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.

    Raises:
        ConfigError: CPU tensors with compiled kernels (``TRITON_INTERPRET=1`` was not set before the first kernel
            module was imported), or CUDA tensors with interpreted kernels; the message says how to fix it.
    """
    from ..errors import ConfigError

    if device_type == "cpu" and not kernels_interpreted():
        raise ConfigError("CPU tensors need Triton's interpreter, but tritonep's kernels were imported for the GPU "
                          "(TRITON_INTERPRET was not 1): set TRITON_INTERPRET=1 before starting Python, and build CPU "
                          "buffers inside tritonep.testing.run_cpu_world(world_size, fn), whose forked ranks share "
                          "one CPU heap (it sets the variable itself when called before any other use of tritonep's "
                          "kernels)")
    if device_type == "cuda" and kernels_interpreted():
        raise ConfigError("CUDA tensors with tritonep's kernels built for Triton's CPU interpreter "
                          "(TRITON_INTERPRET=1 was set when they were imported): unset it on a GPU machine")


@triton.jit
def cast_rne(x, DT: tl.constexpr):
    """fp32 -> DT with round-to-nearest-even, bit-identical on GPU and in the interpreter.

    The Triton 3.6 interpreter truncates fp32 -> bf16 and flushes subnormals; rounding the fp32 bits with integer
    ops and taking the top half as the bf16 pattern gives the same bits everywhere. NaN stays NaN. Other target
    dtypes use the plain cast.
    """
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = tl.where(x != x, b | 0x00400000, b + 0x7FFF + ((b >> 16) & 1))  # NaN stays a (quiet) NaN
        # take the top 16 bits as the bf16 pattern: no float conversion (the interpreter flushes subnormals)
        return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def mul_rn(a, b, USE_ASM: tl.constexpr):
    """fp32 ``a * b`` rounded on its own (never contracted into an FMA with a following add).

    GPU compilers fuse ``acc += a * b`` into one FMA (one rounding); the reference and the interpreter round the
    product first. ``mul.rn.f32`` forbids the contraction, so the GPU sums are bit-identical to the reference.
    """
    if USE_ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def widen(x):
    """Exact conversion to fp32 (bf16 by a 16-bit shift: the Triton 3.6 interpreter's bf16 cast flushes
    subnormals, so the same bits come out on GPU and CPU)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)
