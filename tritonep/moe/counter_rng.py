"""Normal draws that depend only on (key, element index): the same values on every device, GPU kind and SM count.

Why: ``torch.randn`` on a CUDA tensor is not a function of the seed alone. ATen sizes the random kernel's grid from
the device's ``multiProcessorCount`` (``calc_execution_policy`` in ``aten/src/ATen/native/cuda/DistributionTemplates.h``)
and element ``i`` takes the Philox stream of thread ``i mod (grid * 256)``, so a tensor larger than ``SMs * 8 * 256``
elements gets other values on a GPU with another SM count. A process under MPS with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set sees only its share of the SMs (66 of 132 at 50 %), so ranks sharing one
GPU drew other expert weights than a process owning the whole GPU (or a rank of another world size) from the same
seed, and a dense reference rebuilt in the parent no longer matched the layer.

The generator here is counter based (the idea of Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011): element ``i`` of stream ``key`` is ``normal(mix64(i * golden + mix64(key)))``, with the SplitMix64
finalizer (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) as the mixer and
Box-Muller on two 24-bit uniforms cut from the 64-bit word. Integer steps are exact int64 tensor ops (wrapping
multiplies, masked right shifts), so the 64-bit words are the same bits on any device; the Box-Muller step runs in
float64 and is rounded once to float32, so a CPU and a GPU agree to float32 rounding of a float64 result (equal
bits but for rare last-bit ties), and two GPUs of any SM count agree bit for bit.
"""

from __future__ import annotations

import math

import torch

__all__ = ["counter_normal", "stream_key"]

_MASK64 = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15
_CHUNK = 1 << 22  # elements per step: bounds the int64 / float64 temporaries (~32 MB each)


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def _mix64_int(z: int) -> int:
    """The SplitMix64 finalizer on a Python int (mod 2^64)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 finalizer on int64 tensors (multiplies wrap mod 2^64 on every device)."""
    z = (z ^ _srl(z, 30)) * _signed(_M1)
    z = (z ^ _srl(z, 27)) * _signed(_M2)
    return z ^ _srl(z, 31)


def stream_key(*parts: int) -> int:
    """One 64-bit stream key from integers (e.g. ``(seed, expert, tensor)``): each part folded in by the mixer, so
    ``stream_key(1, 23)`` and ``stream_key(12, 3)`` are unrelated streams. Returns a Python int in ``[0, 2^64)``."""
    k = 0x6A09E667F3BCC908
    for p in parts:
        k = _mix64_int(k ^ (int(p) & _MASK64))
    return k


def counter_normal(key: int, shape, device=None, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                   std: float = 1.0) -> torch.Tensor:
    """Standard normal draws (times ``std``) of stream ``key``: element ``i`` (row-major) depends on ``(key, i)`` only.

    Args:
        key: the stream (any int; :func:`stream_key` builds one from several).
        shape: the output shape. device: where to compute (default CPU). dtype: the output's floating dtype.
        out: optional contiguous tensor of ``shape`` to write into (its device and dtype are used).
        std: scale applied in float64 before the one rounding to ``dtype``.

    Returns:
        ``shape`` tensor of ``dtype`` on ``device``. Values lie in about [-5.9, 5.9] (24-bit uniforms).

    Raises:
        ValueError: ``out`` not contiguous or of another shape.
    """
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"counter_normal: out {tuple(out.shape)} (contiguous={out.is_contiguous()}) is not a "
                         f"contiguous {shape} tensor")
    flat = out.view(-1)
    n = flat.numel()
    base = _signed(_mix64_int(key))
    two_pi = 2.0 * math.pi
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        z = _mix64(torch.arange(s, e, dtype=torch.int64, device=flat.device) * _signed(_GOLDEN) + base)
        u1 = (_srl(z, 40).double() + 0.5) * 2.0 ** -24  # (0, 1): the log never sees 0
        u2 = (_srl(z, 16) & 0xFFFFFF).double() * 2.0 ** -24
        flat[s:e] = (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(two_pi * u2) * std).to(flat.dtype)
    return out
