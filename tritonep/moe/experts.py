"""Expert FFN (SwiGLU) over expert-grouped rows, forward and hand-written backward (DESIGN.md §8).

Rows ``x [R, H]`` come from :meth:`tritonep.EPBuffer.dispatch`: segment j (local expert j) is the rows
``[offs[j-1], offs[j])`` with ``offs = expert_offsets`` (cumulative segment ends, ``offs[-1] = 0`` before the first).
For every row r of segment j::

    h = x[r] @ w1[j]                    # [2I]: first half gate, second half up (as tritonep.reference)
    a = silu(h[:I]) * h[I:]             # [I]
    out[r] = a @ w2[j]                  # [H], written straight into the provided output tensor

Precision: the GEMMs run in the parameters' dtype (bf16 or fp32) with fp32 accumulation; the SwiGLU is computed in
fp32 and rounded to the parameters' dtype. Against an fp32 oracle, bf16 parameters give relative errors of a few
1e-3 per GEMM (tests allow 3e-2 of the largest magnitude end to end); fp32 parameters agree to ~1e-5.

Two paths, same math: on CUDA ``torch._grouped_mm(a, b, offs=expert_offsets)`` (no host sync; falls back to the loop
if the op refuses the shapes / dtypes); on CPU (and as the fallback) a loop of ``torch.mm`` over local experts using
one host copy of ``expert_offsets``. The loop writes the second GEMM with ``out=`` into the output rows; the grouped
path has no ``out=`` overload in torch 2.11 / 2.13, so its result is copied into the output once.

Alignment padding rows are zeros: they stay zero in the output (SwiGLU(0) = 0) and add nothing to any gradient.
Rows past ``offs[-1]`` (present only when the host did not know the row count) are set to zero on the loop path and
are unspecified on the grouped path.
"""

from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["ExpertFFN", "expert_ffn", "expert_ffn_forward", "expert_ffn_backward", "swiglu_torch", "storage_alias"]

_GROUPED_REFUSED: set = set()  # (device type, dtype) pairs where torch._grouped_mm raised once: use the loop


def swiglu_torch(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` computed in fp32 and returned in ``h.dtype``; ``h [R, 2I]`` -> ``[R, I]``."""
    inter = h.shape[1] // 2
    g, u = h[:, :inter].float(), h[:, inter:].float()
    return (torch.nn.functional.silu(g) * u).to(h.dtype)


def _check(x, offs, w1, w2, out):
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise InputError(f"need x [R, H], w1 [L, H, 2I], w2 [L, I, H]; got {tuple(x.shape)}, {tuple(w1.shape)}, "
                         f"{tuple(w2.shape)}")
    rows, hidden = x.shape
    n_local, _, inter2 = w1.shape
    if w1.shape[1] != hidden or inter2 % 2 or tuple(w2.shape) != (n_local, inter2 // 2, hidden):
        raise InputError(f"w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)} do not fit hidden={hidden}")
    if offs.dim() != 1 or offs.shape[0] != n_local or offs.dtype not in (torch.int32, torch.int64):
        raise InputError(f"expert_offsets must be int32 [{n_local}], got {offs.dtype} {tuple(offs.shape)}")
    if w1.dtype != w2.dtype or not w1.dtype.is_floating_point:
        raise InputError(f"w1 / w2 must share one float dtype, got {w1.dtype} / {w2.dtype}")
    if out is not None and (tuple(out.shape) != (rows, hidden) or not out.is_contiguous()):
        raise InputError(f"out must be contiguous [{rows}, {hidden}], got {tuple(out.shape)}")


def _use_grouped(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and hasattr(torch, "_grouped_mm") and (t.device.type, t.dtype) not in \
        _GROUPED_REFUSED


def _segments(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    ends = offs.tolist()  # the one host read of the loop path
    out, s = [], 0
    for j, e in enumerate(ends):
        out.append((j, s, e))
        s = e
    return out


def _gmm(a, b, offs):
    return torch._grouped_mm(a, b, offs=offs.to(torch.int32))


def expert_ffn_forward(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the grouped SwiGLU FFN (no autograd).

    Args:
        x: ``[R, H]`` rows (bf16 or the parameters' dtype), expert-grouped.
        offs: ``[L]`` int32 cumulative segment ends (``Dispatched.expert_offsets``).
        w1: ``[L, H, 2I]``; w2: ``[L, I, H]`` (same float dtype).
        out: contiguous ``[R, H]`` tensor that receives the result (e.g. ``EPBuffer.expert_out_buffer(R)``);
            allocated in ``x.dtype`` when None.

    Returns:
        ``(out, h)``: ``out`` is the tensor passed in (now holding the result); ``h [R, 2I]`` (parameters' dtype)
        is the first GEMM's output, kept for the backward.

    Raises:
        InputError: shapes / dtypes that do not agree.
    """
    with torch.no_grad():
        return _forward_impl(x, offs, w1, w2, out)


def _forward_impl(x, offs, w1, w2, out):
    _check(x, offs, w1, w2, out)
    dt = w1.dtype
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xa = x.to(dt)
    if _use_grouped(xa):
        try:
            h = _gmm(xa, w1, offs)
            o = _gmm(swiglu_torch(h), w2, offs)
            out.copy_(o)
            return out, h
        except RuntimeError:
            _GROUPED_REFUSED.add((xa.device.type, dt))
    h = torch.empty(x.shape[0], w1.shape[2], dtype=dt, device=x.device)
    segs = _segments(offs)
    end = segs[-1][2] if segs else 0
    h[end:].zero_()
    out[end:].zero_()
    for j, s, e in segs:
        if e > s:
            torch.mm(xa[s:e], w1[j], out=h[s:e])
    a = swiglu_torch(h)
    for j, s, e in segs:
        if e > s:
            if out.dtype == dt:
                torch.mm(a[s:e], w2[j], out=out[s:e])
            else:
                out[s:e].copy_(a[s:e] @ w2[j])
    return out, h


def _swiglu_backward(h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    inter = h.shape[1] // 2
    g, u = h[:, :inter].float(), h[:, inter:].float()
    sig = torch.sigmoid(g)
    ga = grad_a.float()
    grad_g = ga * u * (sig * (1.0 + g * (1.0 - sig)))
    grad_u = ga * (g * sig)
    return torch.cat([grad_g, grad_u], dim=1).to(h.dtype)


def expert_ffn_backward(grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`expert_ffn_forward`, by hand.

    Args:
        grad_out: ``[R, H]`` gradient of the output rows. x, offs, w1, w2: the forward's inputs. h: its ``h``.

    Returns:
        ``(grad_x [R, H] in x.dtype, grad_w1 [L, H, 2I], grad_w2 [L, I, H])`` (weight grads in the parameters'
        dtype; experts with no rows get zeros).
    """
    with torch.no_grad():
        return _backward_impl(grad_out, x, offs, w1, w2, h)


def _backward_impl(grad_out, x, offs, w1, w2, h):
    dt = w1.dtype
    go = grad_out.to(dt)
    xa = x.to(dt)
    a = swiglu_torch(h)
    if _use_grouped(xa):
        try:
            grad_a = _gmm(go, w2.transpose(1, 2), offs)
            grad_w2 = _gmm(a.t(), go, offs)
            grad_h = _swiglu_backward(h, grad_a)
            grad_x = _gmm(grad_h, w1.transpose(1, 2), offs)
            grad_w1 = _gmm(xa.t(), grad_h, offs)
            return grad_x.to(x.dtype), grad_w1, grad_w2
        except RuntimeError:
            _GROUPED_REFUSED.add((xa.device.type, dt))
    grad_a = torch.zeros(x.shape[0], h.shape[1] // 2, dtype=dt, device=x.device)
    grad_w1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    segs = _segments(offs)
    for j, s, e in segs:
        if e > s:
            torch.mm(go[s:e], w2[j].t(), out=grad_a[s:e])
            torch.mm(a[s:e].t(), go[s:e], out=grad_w2[j])
    grad_h = _swiglu_backward(h, grad_a)
    grad_x = torch.zeros(x.shape, dtype=dt, device=x.device)
    for j, s, e in segs:
        if e > s:
            torch.mm(grad_h[s:e], w1[j].t(), out=grad_x[s:e])
            torch.mm(xa[s:e].t(), grad_h[s:e], out=grad_w1[j])
    return grad_x.to(x.dtype), grad_w1, grad_w2


def storage_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (same storage, offset, shape, strides) that is NOT an autograd view of it.

    Regions of a symmetric buffer are views of one big byte tensor, so they share its version counter: every
    in-place write anywhere in the buffer (e.g. a kernel's call counter) would look like a modification of a saved
    expert output, and autograd forbids views created inside a custom Function whose base changes. The alias has
    its own version counter and no view relation, so autograd treats it as a fresh tensor.
    """
    with torch.no_grad():
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                  t.shape, t.stride())


class ExpertFFN(torch.autograd.Function):
    """Autograd wrapper: ``ExpertFFN.apply(x, offs, w1, w2, out) -> out'`` (see :func:`expert_ffn`); ``out'`` is
    :func:`storage_alias` of ``out`` (same memory, no view relation to the symmetric buffer)."""

    @staticmethod
    def forward(ctx, x, offs, w1, w2, out):
        res, h = expert_ffn_forward(x, offs, w1, w2, storage_alias(out))
        ctx.save_for_backward(x, offs, w1, w2, h)
        return res

    @staticmethod
    def backward(ctx, grad_out):
        x, offs, w1, w2, h = ctx.saved_tensors
        gx, gw1, gw2 = expert_ffn_backward(grad_out, x, offs, w1, w2, h)
        return (gx if ctx.needs_input_grad[0] else None), None, \
            (gw1 if ctx.needs_input_grad[2] else None), (gw2 if ctx.needs_input_grad[3] else None), None


def expert_ffn(x: torch.Tensor, expert_offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable grouped SwiGLU FFN writing into ``out`` (zero copy into combine on the loop path).

    Args / errors: see :func:`expert_ffn_forward`. Differentiable w.r.t. ``x``, ``w1``, ``w2``.

    Returns:
        ``[R, H]`` sharing ``out``'s memory (a grad-tracked :func:`storage_alias` of it). The alias does not
        notice later writes into ``out``'s memory: a forward that reuses the region before this output's backward
        ran makes that backward read the new values.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return ExpertFFN.apply(x, expert_offsets, w1, w2, out)
