"""Expert FFN (SwiGLU, or another activation of :mod:`tritonep.moe.activations`) over expert-grouped rows, forward
and hand-written backward (docs/moe.md).

Rows ``x [R, H]`` come from :meth:`tritonep.EPBuffer.dispatch`: segment j (local expert j) is the rows
``[offs[j-1], offs[j])`` with ``offs = expert_offsets`` (cumulative segment ends, ``offs[-1] = 0`` before the first).
For every row r of segment j::

    h = x[r] @ w1[j]                    # [2I]: first half gate, second half up (as tritonep.reference)
    a = silu(h[:I]) * h[I:]             # [I]
    out[r] = a @ w2[j]                  # [H], written straight into the provided output tensor

Every function takes ``act`` (default ``"swiglu"``), a name of :data:`tritonep.moe.ACTIVATIONS`: a gated activation
uses w1 ``[L, H, 2I]`` as above, a plain one w1 ``[L, H, I]`` and ``a = f(h)``.

Precision: the GEMMs run in the parameters' dtype (bf16 or fp32) with fp32 accumulation; the SwiGLU is computed in
fp32 and rounded to the parameters' dtype. Against an fp32 oracle, bf16 parameters give relative errors of a few
1e-3 per GEMM (tests allow 3e-2 of the largest magnitude end to end); fp32 parameters agree to ~1e-5.

Two paths, same math: on CUDA ``torch._grouped_mm(a, b, offs=expert_offsets)`` (no host sync; falls back to the loop
if the op refuses the shapes / dtypes); on CPU (and as the fallback) a loop of ``torch.mm`` over local experts using
one host copy of ``expert_offsets``. The loop writes the second GEMM with ``out=`` into the output rows; the grouped
path has no ``out=`` overload in torch 2.11 / 2.13, so its result is copied into the output once.

Alignment padding rows are zeros: they stay zero in the output (SwiGLU(0) = 0) and add nothing to any gradient.
Rows past ``offs[-1]`` (present only when the host did not know the row count) are set to zero on the loop path and
are unspecified on the grouped path. A run with no experts or no rows does no GEMM (its output rows are zeroed).

Split runs (:func:`expert_ffn_parts`): the rows may be cut at host-known boundaries into parts, each with its own
weight tensors and its own offsets (relative to the part's first row). The math is that of one run over the
concatenated weights, without concatenating them: the virtual-expert layer runs its native experts from the
parameters and only the virtual slots used this step from views of the symmetric slots (``tritonep.balance``), so no
expert weight is copied and weight gradients exist only for the experts of each part. The forward still writes every
part straight into ``out``; the backward of a split run assembles ``grad_x`` from the parts (one ``[R, H]`` copy).
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .activations import get_activation, swiglu_torch  # swiglu_torch: re-exported (public name of this module)

__all__ = ["ExpertFFN", "expert_ffn", "expert_ffn_forward", "expert_ffn_backward", "ExpertFFNParts", "expert_ffn_parts",
           "expert_ffn_parts_forward", "expert_ffn_parts_backward", "swiglu_torch", "storage_alias"]

_GROUPED_REFUSED: set = set()  # (device type, dtype) pairs where torch._grouped_mm raised once: use the loop


def _check(x, offs, w1, w2, out, act="swiglu"):
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise InputError(f"need x [R, H], w1 [L, H, 2I], w2 [L, I, H]; got {tuple(x.shape)}, {tuple(w1.shape)}, "
                         f"{tuple(w2.shape)}")
    rows, hidden = x.shape
    n_local, _, width = w1.shape
    gated = get_activation(act).gated
    if w1.shape[1] != hidden or (gated and width % 2) or \
            tuple(w2.shape) != (n_local, width // 2 if gated else width, hidden):
        raise InputError(f"w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)} do not fit hidden={hidden} and the "
                         f"{'gated' if gated else 'plain'} activation {act!r}")
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
                       out: torch.Tensor | None = None, act: str = "swiglu") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the grouped SwiGLU FFN (no autograd).

    Args:
        x: ``[R, H]`` rows (bf16 or the parameters' dtype), expert-grouped.
        offs: ``[L]`` int32 cumulative segment ends (``Dispatched.expert_offsets``).
        w1: ``[L, H, 2I]``; w2: ``[L, I, H]`` (same float dtype).
        out: contiguous ``[R, H]`` tensor that receives the result (e.g. ``EPBuffer.expert_out_buffer(R)``);
            allocated in ``x.dtype`` when None.
        act: the activation's name (:data:`tritonep.moe.ACTIVATIONS`).

    Returns:
        ``(out, h)``: ``out`` is the tensor passed in (now holding the result); ``h [R, width]`` (parameters' dtype)
        is the first GEMM's output, kept for the backward.

    Raises:
        InputError: shapes / dtypes that do not agree.
    """
    with torch.no_grad():
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return _forward_part(x, offs, w1, w2, out, act)


def _forward_part(x, offs, w1, w2, out, act="swiglu"):
    _check(x, offs, w1, w2, out, act)
    if w1.shape[0] == 0 or x.shape[0] == 0:  # nothing to multiply: no GEMM launch (the grouped op may refuse it)
        out.zero_()
        return out, torch.zeros(x.shape[0], w1.shape[2], dtype=w1.dtype, device=x.device)
    return _forward_impl(x, offs, w1, w2, out, get_activation(act))


def _forward_impl(x, offs, w1, w2, out, act):
    dt = w1.dtype
    xa = x.to(dt)
    if _use_grouped(xa):
        try:
            h = _gmm(xa, w1, offs)
            o = _gmm(act.forward(h), w2, offs)
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
    a = act.forward(h)
    for j, s, e in segs:
        if e > s:
            if out.dtype == dt:
                torch.mm(a[s:e], w2[j], out=out[s:e])
            else:
                out[s:e].copy_(a[s:e] @ w2[j])
    return out, h


def expert_ffn_backward(grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, h: torch.Tensor, act: str = "swiglu"
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`expert_ffn_forward`, by hand.

    Args:
        grad_out: ``[R, H]`` gradient of the output rows. x, offs, w1, w2, act: the forward's inputs. h: its ``h``.

    Returns:
        ``(grad_x [R, H] in x.dtype, grad_w1 [L, H, 2I], grad_w2 [L, I, H])`` (weight grads in the parameters'
        dtype; experts with no rows get zeros).
    """
    with torch.no_grad():
        return _backward_part(grad_out, x, offs, w1, w2, h, act)


def _backward_part(grad_out, x, offs, w1, w2, h, act="swiglu"):
    if w1.shape[0] == 0 or x.shape[0] == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device), torch.zeros_like(w1), torch.zeros_like(w2)
    return _backward_impl(grad_out, x, offs, w1, w2, h, get_activation(act))


def _backward_impl(grad_out, x, offs, w1, w2, h, act):
    dt = w1.dtype
    go = grad_out.to(dt)
    xa = x.to(dt)
    a = act.forward(h)
    if _use_grouped(xa):
        try:
            grad_a = _gmm(go, w2.transpose(1, 2), offs)
            grad_w2 = _gmm(a.t(), go, offs)
            grad_h = act.backward(h, grad_a)
            grad_x = _gmm(grad_h, w1.transpose(1, 2), offs)
            grad_w1 = _gmm(xa.t(), grad_h, offs)
            return grad_x.to(x.dtype), grad_w1, grad_w2
        except RuntimeError:
            _GROUPED_REFUSED.add((xa.device.type, dt))
    grad_a = torch.zeros(x.shape[0], w2.shape[1], dtype=dt, device=x.device)
    grad_w1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    segs = _segments(offs)
    for j, s, e in segs:
        if e > s:
            torch.mm(go[s:e], w2[j].t(), out=grad_a[s:e])
            torch.mm(a[s:e].t(), go[s:e], out=grad_w2[j])
    grad_h = act.backward(h, grad_a)
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
    def forward(ctx, x, offs, w1, w2, out, act="swiglu"):
        res, h = expert_ffn_forward(x, offs, w1, w2, storage_alias(out), act)
        ctx.save_for_backward(x, offs, w1, w2, h)
        ctx.act = act
        return res

    @staticmethod
    def backward(ctx, grad_out):
        x, offs, w1, w2, h = ctx.saved_tensors
        gx, gw1, gw2 = expert_ffn_backward(grad_out, x, offs, w1, w2, h, ctx.act)
        return (gx if ctx.needs_input_grad[0] else None), None, \
            (gw1 if ctx.needs_input_grad[2] else None), (gw2 if ctx.needs_input_grad[3] else None), None, None


def expert_ffn(x: torch.Tensor, expert_offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               out: torch.Tensor | None = None, act: str = "swiglu") -> torch.Tensor:
    """Differentiable grouped SwiGLU FFN writing into ``out`` (zero copy into combine on the loop path).

    Args / errors: see :func:`expert_ffn_forward`. Differentiable w.r.t. ``x``, ``w1``, ``w2``.

    Returns:
        ``[R, H]`` sharing ``out``'s memory (a grad-tracked :func:`storage_alias` of it). The alias does not
        notice later writes into ``out``'s memory: a forward that reuses the region before this output's backward
        ran makes that backward read the new values.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return ExpertFFN.apply(x, expert_offsets, w1, w2, out, act)


# ------------------------------------------------------------------------------------------------ split runs
def _check_parts(x, bounds, offs, w1, w2, out):
    n = len(offs)
    if n < 1 or len(w1) != n or len(w2) != n or len(bounds) != n + 1:
        raise InputError(f"need P >= 1 parts with P offsets / w1 / w2 and P + 1 bounds, got {len(offs)} offsets, "
                         f"{len(w1)} w1, {len(w2)} w2, {len(bounds)} bounds")
    if x.dim() != 2:
        raise InputError(f"need x [R, H], got {tuple(x.shape)}")
    b = [int(v) for v in bounds]
    if b[0] != 0 or b[-1] != x.shape[0] or any(b[i] > b[i + 1] for i in range(n)):
        raise InputError(f"bounds={b} must rise from 0 to the row count {x.shape[0]}")
    if out is not None and (tuple(out.shape) != tuple(x.shape) or not out.is_contiguous()):
        raise InputError(f"out must be contiguous [{x.shape[0]}, {x.shape[1]}], got {tuple(out.shape)}")
    return b


def expert_ffn_parts_forward(x: torch.Tensor, bounds, offs, w1, w2, out: torch.Tensor | None = None,
                             act: str = "swiglu") -> tuple[torch.Tensor, list]:
    """Forward of the grouped SwiGLU FFN over row parts with separate weights (no autograd, no weight copy).

    Equals :func:`expert_ffn_forward` over the concatenated weights ``cat(w1)`` / ``cat(w2)`` when part p's experts
    follow part p-1's and ``offs[p]`` are their segment ends counted from ``bounds[p]``.

    Args:
        x: ``[R, H]`` expert-grouped rows.
        bounds: ``P + 1`` host ints, ``0 = bounds[0] <= ... <= bounds[P] = R``: part p is rows
            ``[bounds[p], bounds[p+1])``.
        offs: ``P`` int32/int64 tensors, ``offs[p]`` ``[L_p]`` cumulative segment ends relative to ``bounds[p]``
            (``offs[p][-1] <= bounds[p+1] - bounds[p]``; rows after it are treated as rows past the end).
        w1, w2: ``P`` tensors each, ``[L_p, H, 2I]`` / ``[L_p, I, H]`` (one float dtype; ``L_p`` may be 0).
        out: contiguous ``[R, H]`` output (allocated in ``x.dtype`` when None); every part writes its rows there.

    Returns:
        ``(out, hs)``: ``hs`` the list of the P first-GEMM outputs ``[bounds[p+1] - bounds[p], 2I]``.

    Raises:
        InputError: inconsistent part counts, bounds, shapes or dtypes.
    """
    with torch.no_grad():
        b = _check_parts(x, bounds, offs, w1, w2, out)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        hs = []
        for p in range(len(offs)):
            hs.append(_forward_part(x[b[p]:b[p + 1]], offs[p], w1[p], w2[p], out[b[p]:b[p + 1]], act)[1])
        return out, hs


def expert_ffn_parts_backward(grad_out: torch.Tensor, x: torch.Tensor, bounds, offs, w1, w2, hs,
                              act: str = "swiglu") -> tuple[torch.Tensor, list, list]:
    """Backward of :func:`expert_ffn_parts_forward`, by hand.

    Returns:
        ``(grad_x [R, H] in x.dtype, grad_w1, grad_w2)``: lists of P tensors shaped like ``w1[p]`` / ``w2[p]``
        (experts with no rows get zeros). With P > 1 ``grad_x`` is assembled from the parts (one ``[R, H]`` copy).

    Raises:
        InputError: as the forward.
    """
    with torch.no_grad():
        b = _check_parts(x, bounds, offs, w1, w2, None)
        gx, g1, g2 = [], [], []
        for p in range(len(offs)):
            s, e = b[p], b[p + 1]
            a, c, d = _backward_part(grad_out[s:e], x[s:e], offs[p], w1[p], w2[p], hs[p], act)
            gx.append(a)
            g1.append(c)
            g2.append(d)
        return (gx[0] if len(gx) == 1 else torch.cat(gx)), g1, g2


class ExpertFFNParts(torch.autograd.Function):
    """Autograd wrapper of a split run: ``ExpertFFNParts.apply(x, out, bounds, offs, act, *w1, *w2) -> out'`` (see
    :func:`expert_ffn_parts`); ``out'`` is :func:`storage_alias` of ``out``."""

    @staticmethod
    def forward(ctx, x, out, bounds, offs, act, *weights):
        n = len(offs)
        res, hs = expert_ffn_parts_forward(x, bounds, offs, weights[:n], weights[n:], storage_alias(out), act)
        ctx.bounds, ctx.num_parts, ctx.act = list(bounds), n, act
        ctx.save_for_backward(x, *offs, *weights, *hs)
        return res

    @staticmethod
    def backward(ctx, grad_out):
        n, saved = ctx.num_parts, ctx.saved_tensors
        x, offs, w1, w2, hs = saved[0], saved[1:1 + n], saved[1 + n:1 + 2 * n], saved[1 + 2 * n:1 + 3 * n], \
            saved[1 + 3 * n:]
        gx, g1, g2 = expert_ffn_parts_backward(grad_out, x, ctx.bounds, offs, w1, w2, hs, ctx.act)
        gw = [g if need else None for g, need in zip(g1 + g2, ctx.needs_input_grad[5:])]
        return (gx if ctx.needs_input_grad[0] else None), None, None, None, None, *gw


def expert_ffn_parts(x: torch.Tensor, bounds, offs, w1, w2, out: torch.Tensor | None = None,
                     act: str = "swiglu") -> torch.Tensor:
    """Differentiable split run of the grouped expert FFN, every part writing into ``out`` (no weight copy).

    Args / errors: see :func:`expert_ffn_parts_forward`. Differentiable w.r.t. ``x`` and every ``w1[p]``,
    ``w2[p]`` (each gets a gradient of its own shape: no gradient is made for experts outside the parts).

    Returns:
        ``[R, H]`` sharing ``out``'s memory (a grad-tracked :func:`storage_alias`, as :func:`expert_ffn`).
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    offs, w1, w2 = tuple(offs), tuple(w1), tuple(w2)
    if len(w1) != len(offs) or len(w2) != len(offs):
        raise InputError(f"need one w1 and one w2 per part: {len(offs)} offsets, {len(w1)} w1, {len(w2)} w2")
    return ExpertFFNParts.apply(x, out, list(bounds), offs, act, *w1, *w2)
