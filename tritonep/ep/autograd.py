"""Autograd for dispatch and combine (docs/architecture.md).

dispatch: ``(x [T,H], topk_weights [T,K]) -> (recv_x [R,H], recv_weights [R])``; its backward is a combine without
weights (``grad_x[t] = sum_k grad_recv_x[row(t,k)]``) plus a gather of the per-row weight gradients
(``grad_topk_weights[t,k] = grad_recv_weights[row(t,k)]``).

combine: ``(expert_out [R,H], recv_weights [R]) -> y [T,H]``; its backward is a dispatch of ``grad_y`` scaled by the
route weight (``grad_expert_out[row] = w * grad_y[t]``) plus ``grad_recv_weights[row] = <grad_y[t], expert_out[row]>``
computed where the row lives.

Higher-order gradients (``torch.autograd.grad(..., create_graph=True)``: a gradient penalty, a Hessian-vector
product). Dispatch is linear in the tokens and in the weights, combine bilinear in (expert rows, weights), so with
``P`` the ``[R, T]`` row map of the handle (``P[row(t, k), t] = 1``) and ``S`` its ``[R, T*K]`` route map:
dispatch = ``(P x, S w)``, its backward ``(P^T g, S^T g_w)`` (:class:`DispatchBwdFn`, linear again), whose own
backward is ``(P u, S v)``: a new dispatch of ``(u, v)`` along the handle's routing (:class:`Redispatch`: same
routing, hence the same layout and rows). Combine's backward is ``g_eo = diag(w) P g_y`` and ``g_w[row] =
<(P g_y)[row], eo[row]>``; under ``create_graph`` it is computed from ``P g_y`` (a :class:`Redispatch` of ``g_y``)
with torch ops on ``w`` and ``eo``, so autograd differentiates it w.r.t. ``g_y``, ``w`` and ``eo`` (same bits for
``g_eo``: ``w * g`` in fp32 rounded once to bf16, as the kernel). Without ``create_graph`` the backward passes are
the backend's kernels (``dispatch_bwd`` / ``combine_bwd`` of :class:`tritonep.backends.interface.EPBackend`), never
graph-building. Forward-mode AD (``torch.autograd.forward_ad``): the tangent of a dispatch is the dispatch of the
tangents, ``(P dx, S dw)``, and that of a combine ``P^T (w * d_eo + dw * eo)`` per row (:meth:`DispatchFn.jvp`,
:meth:`CombineFn.jvp`; one more collective each, on every rank that passes dual tensors: every rank must). Every
function here is a collective (every rank differentiates the same graph, so every rank runs the same calls in the
same order).
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _fwd

from .. import envs
from ..wire.formats import get_wire

__all__ = ["DispatchFn", "CombineFn", "DispatchBwdFn", "Redispatch", "combine_bwd_graph", "has_tangent"]


def has_tangent(*tensors) -> bool:
    """Whether any of ``tensors`` (None allowed) is a forward-mode dual tensor of the open dual level
    (``torch.autograd.forward_ad``); False at once when no level is open (the common case: one module read)."""
    if _fwd._current_level < 0:
        return False
    return any(t is not None and _fwd.unpack_dual(t).tangent is not None for t in tensors)


def _dispatch_rows(impl, handle, u, v):
    """``(P u [rows, H], S v [rows], real)``: ``u [T, H]`` (and ``v [T, K]`` float32, or zeros) dispatched along
    ``handle``'s routing (the handle's own copy), with the rows the handle's dispatch returned: exactly ``R`` for a
    synced handle, ``max_recv_tokens`` (the tail zero) for a sync-free one, whose bool ``[rows]`` mask of the rows
    of the layout is ``real`` (None for a synced handle: every row is). Collective."""
    cfg = impl.cfg
    T, K = handle.num_tokens, cfg.topk
    sync_free = handle.num_recv_rows is None
    sync = envs.SYNC_NONE if sync_free else envs.SYNC_DEFERRED
    u = u.to(cfg.dtype).contiguous()
    no_v = v is None
    v = torch.zeros(T, K, dtype=torch.float32, device=u.device) if no_v else v.float().contiguous()
    if get_wire(cfg.dispatch_wire).quantized:
        # a quantized dispatch wire would round u's rows (reverse mode moves gradients raw: P^T and the combine
        # backward are bf16): move them as the combine backward does, along a dispatch of unit weights
        # (``bf16(1.0 * u[t])`` = ``u[t]``; padding and rows past the layout are zero); the route weights ``S v``
        # travel exactly (fp32) in the dispatch of ``v``
        ones = torch.ones(T, K, dtype=torch.float32, device=u.device)
        _, _, _, offs, unit = impl.dispatch_fwd(u, handle.topk_idx, ones, sync, sync_free=sync_free)
        rows = cfg.max_recv_tokens if sync_free else unit.num_recv_rows
        out, _ = impl.combine_bwd(u, torch.zeros(rows, cfg.hidden, dtype=cfg.dtype, device=u.device), unit)
        if no_v:
            out_w = torch.zeros(rows, dtype=torch.float32, device=u.device)
        else:
            _, out_w, _, _, _ = impl.dispatch_fwd(u, handle.topk_idx, v, sync, sync_free=sync_free)
        real = torch.arange(rows, device=out.device) < offs[-1] if sync_free else None
        return out, out_w.clone(), real
    out, out_w, _, offs, _ = impl.dispatch_fwd(u, handle.topk_idx, v, sync, sync_free=sync_free)
    real = None
    if sync_free:  # rows past the layout are unspecified: a gradient there is 0
        real = torch.arange(out.shape[0], device=out.device) < offs[-1]
        out = torch.where(real[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    elif out._base is not None:
        out = out.clone()  # a pooled block's cut: a tensor of its own
    return out, out_w.clone(), real


class Redispatch(torch.autograd.Function):
    """``(u [T, H], v [T, K] | None) -> (P u, S v, real)`` along an existing handle's routing (module docstring;
    ``real``: bool mask of the rows of the layout); its backward is :class:`DispatchBwdFn` (the transpose), so it
    is differentiable to any order."""

    @staticmethod
    def forward(ctx, u, v, impl, handle):
        """``(P u, S v, real)`` (:func:`_dispatch_rows`; ``real`` not differentiable)."""
        ctx.impl, ctx.handle = impl, handle
        ctx.has_v = v is not None
        pu, sv, real = _dispatch_rows(impl, handle, u, v)
        if real is None:
            real = torch.ones(pu.shape[0], dtype=torch.bool, device=pu.device)
        ctx.mark_non_differentiable(real)
        return pu, sv, real

    @staticmethod
    def jvp(ctx, du, dv, *_):
        """Linear: the tangent is the same dispatch of the tangents (forward-mode AD, e.g. forward-over-reverse)."""
        pu, sv, _ = _dispatch_rows(ctx.impl, ctx.handle, du, dv if ctx.has_v else None)
        return pu, sv, None

    @staticmethod
    def backward(ctx, g, g_w, _g_real):
        g = torch.zeros(0) if g is None else g
        gx, gw = DispatchBwdFn.apply(_rows_like(ctx, g), g_w, ctx.impl, ctx.handle)
        return gx, (gw if ctx.has_v else None), None, None


def _rows_like(ctx, g):
    """``g``, or zeros of the handle's rows when autograd gave none."""
    if g.dim() == 2:
        return g
    cfg, rows = ctx.impl.cfg, ctx.handle.num_recv_rows
    return torch.zeros(cfg.max_recv_tokens if rows is None else rows, cfg.hidden, dtype=cfg.dtype,
                       device=ctx.impl.device)


class DispatchBwdFn(torch.autograd.Function):
    """``(g [R, H], g_w [R] | None) -> (P^T g [T, H], S^T g_w [T, K] | None)``: the dispatch backward
    (:meth:`dispatch_bwd` of the backend) as a differentiable function; its backward is :class:`Redispatch`."""

    @staticmethod
    def forward(ctx, g, g_w, impl, handle):
        ctx.impl, ctx.handle = impl, handle
        ctx.has_w = g_w is not None
        return impl.dispatch_bwd(g.contiguous(), g_w.contiguous() if g_w is not None else None, handle)

    @staticmethod
    def jvp(ctx, dg, dg_w, *_):
        """Linear: the tangent is the same dispatch backward of the tangents."""
        return ctx.impl.dispatch_bwd(dg.contiguous(), dg_w.contiguous() if ctx.has_w else None, ctx.handle)

    @staticmethod
    def backward(ctx, u, v):
        if u is None:
            h = ctx.handle
            u = torch.zeros(h.num_tokens, ctx.impl.cfg.hidden, dtype=ctx.impl.cfg.dtype, device=ctx.impl.device)
        pu, sv, _ = Redispatch.apply(u, v if ctx.has_w else None, ctx.impl, ctx.handle)
        return pu, (sv if ctx.has_w else None), None, None


class DispatchFn(torch.autograd.Function):
    """``(x, topk_weights) -> (recv_x, recv_weights, num_tokens_per_expert, expert_offsets)`` through a backend;
    backward = a combine without weights plus the return of the per-row weight gradients (module docstring);
    forward-mode tangent (:meth:`jvp`) = the same dispatch of the tangents ``(P dx, S dw)``."""

    @staticmethod
    def forward(ctx, x, topk_weights, impl, topk_idx, sync, sync_free, box, count=None, kq=False):
        # kq (keep_quantized): the rows are the wire's bytes (no gradient; the caller passes x detached), the row
        # weights keep theirs
        out, out_w, ntpe, offs, handle = impl.dispatch_fwd(x, topk_idx, topk_weights, sync, kq, sync_free=sync_free,
                                                           count=count)
        # autograd refuses in-place ops on a view made inside a custom Function, and the rows may be a cut of a
        # larger block (decode, pooled: tritonep/runtime/pool.py): hand out an alias of its own (no view; same
        # storage, so the pool still sees it held). The row weights stay a view on purpose: combine uses the
        # weights the dispatch moved, so an in-place change of them would change the gradient but not the sum
        if out._base is not None:
            out = out.detach()
        if _fwd._current_level >= 0 and out_w._base is not None:
            # forward-mode AD asks the tangent of a view output to be a view of its base's tangent: return an alias
            # of its own (same storage, so it stays the weights the dispatch moved) and keep it as the handle's
            out_w = out_w.detach()
            object.__setattr__(handle, "recv_weights", out_w)
        box.append(handle)  # handle.recv_weights is out_w: the very tensor autograd returns (tracked)
        ctx.impl = impl
        ctx.handle = handle
        ctx.kq = kq
        ctx.mark_non_differentiable(*((out, ntpe, offs) if kq else (ntpe, offs)))
        # saved for its version counter only: combine and the backward passes use the weights the dispatch moved, so
        # an in-place change of the returned weights (``d.weights.mul_(2)``) would change the gradient (through the
        # in-place op's own backward) but not the forward sum; autograd refuses it at backward, as torch does for
        # any saved tensor modified in place (every path: pooled or not, either backend, graph capture)
        ctx.save_for_backward(out_w)
        return out, out_w, ntpe, offs

    @staticmethod
    def jvp(ctx, dx, dw, *_):
        """Forward-mode AD (``torch.autograd.forward_ad`` dual tensors): dispatch is linear in ``(x, topk_weights)``,
        so the tangents of ``(recv_x, recv_weights)`` are ``(P dx, S dw)``: one more dispatch, of the tangents, along
        this call's routing (:func:`_dispatch_rows`; a sync-free handle's rows past the layout get 0). Collective:
        every rank passes dual tensors alike (forward AD transforms the whole program on every rank)."""
        pu, sv, _ = _dispatch_rows(ctx.impl, ctx.handle, dx, dw)
        return pu, sv, None, None

    @staticmethod
    def backward(ctx, grad_out, grad_out_w, _g1, _g2):
        ctx.saved_tensors  # noqa: B018 - raises if the returned weights were modified in place since the dispatch
        if grad_out is None or ctx.kq:  # kept quantized rows: no gradient of theirs (zero rows: x gets none)
            grad_out = _rows_like(ctx, torch.zeros(0))
        if torch.is_grad_enabled() or has_tangent(grad_out, grad_out_w):
            # create_graph: the backward is differentiable again (module docstring); dual gradients (forward over
            # reverse): DispatchBwdFn carries their tangent (its jvp)
            grad_x, grad_w = DispatchBwdFn.apply(grad_out, grad_out_w, ctx.impl, ctx.handle)
            return (None if ctx.kq else grad_x), grad_w, None, None, None, None, None, None, None
        gw = grad_out_w.contiguous() if grad_out_w is not None else None  # autograd may hand expanded grads
        grad_x, grad_w = ctx.impl.dispatch_bwd(grad_out.contiguous(), gw, ctx.handle)
        return (None if ctx.kq else grad_x), grad_w, None, None, None, None, None, None, None


class CombineFn(torch.autograd.Function):
    """``(expert_out, recv_weights) -> y``; backward = a dispatch of ``grad_y`` scaled by the route weights plus
    ``<grad_y, expert_out row>`` per row (module docstring); forward-mode tangent (:meth:`jvp`) = a dispatch
    backward of ``w * d_eo + dw * eo`` per row."""

    @staticmethod
    def forward(ctx, expert_out, recv_weights, impl, handle, kind, read=False):
        y = impl.combine_fwd(expert_out, handle, kind=kind, read=read)
        if y._base is not None:  # a view of a pooled block (decode, tritonep/runtime/pool.py): autograd refuses
            y = y.detach()  # in-place ops on a view made inside a custom Function; an alias of its own is no view
        ctx.impl = impl
        ctx.handle = handle
        ctx.save_for_backward(expert_out, recv_weights)
        if _fwd._current_level >= 0:  # a dual level is open: jvp may run right after (saved_tensors are backward's)
            ctx.primals = (expert_out, recv_weights)
        return y

    @staticmethod
    def jvp(ctx, d_eo, d_w, *_):
        """Forward-mode AD: ``y[t] = sum_(row of t) w[row] * eo[row]`` is bilinear, so ``dy[t] = sum_(row of t)
        (w[row] * d_eo[row] + dw[row] * eo[row])``: the per-row sums in fp32, rounded once to bf16, summed back to
        the tokens by the dispatch backward (P^T, the combine without weights; one collective). ``w`` are the weights
        the dispatch moved (the ones the forward used). Collective: every rank passes dual tensors alike."""
        eo, _ = ctx.primals
        del ctx.primals
        impl, handle = ctx.impl, ctx.handle
        rows = handle.num_recv_rows
        R = impl.cfg.max_recv_tokens if rows is None else rows
        w = handle.recv_weights.detach()[:R, None]
        g = w * d_eo[:R].float() if d_eo is not None else torch.zeros(R, eo.shape[1], device=eo.device)
        if d_w is not None:
            g = g + d_w[:R, None].float() * eo[:R].float()
        dy, _ = impl.dispatch_bwd(g.to(impl.cfg.dtype).contiguous(), None, handle)
        return dy

    @staticmethod
    def backward(ctx, grad_y):
        expert_out, recv_weights = ctx.saved_tensors
        if torch.is_grad_enabled() or has_tangent(grad_y, expert_out, recv_weights):
            # create_graph, or dual tensors (forward over reverse): from P grad_y with torch ops (module docstring)
            return combine_bwd_graph(ctx.impl, ctx.handle, grad_y, expert_out, recv_weights) + (None,) * 4
        g_eo, g_w = ctx.impl.combine_bwd(grad_y.contiguous(), expert_out, ctx.handle)
        return g_eo, g_w, None, None, None, None


def combine_bwd_graph(impl, handle, grad_y, expert_out, recv_weights):
    """Combine's backward as differentiable ops: ``(g_eo, g_w)`` with ``g_eo = bf16(w * P g_y)``, ``g_w = <P g_y,
    eo>`` per row (rows past ``expert_out``'s used rows get 0; ``recv_weights`` None: the handle's weights, not
    differentiated, and ``g_w`` None). Autograd and forward-mode AD go through it (:class:`Redispatch`). Collective."""
    pg, _, real = Redispatch.apply(grad_y, None, impl, handle)
    R = pg.shape[0]
    w = recv_weights if recv_weights is not None else handle.recv_weights.detach()
    w = w[:R]
    g_eo = (w[:, None] * pg.float()).to(expert_out.dtype)
    if expert_out.shape[0] > R:  # a longer expert_out (e.g. the whole expert_out_buffer): its extra rows get 0
        g_eo = torch.cat([g_eo, g_eo.new_zeros(expert_out.shape[0] - R, g_eo.shape[1])])
    g_w = None
    if recv_weights is not None:  # rows past a sync-free layout: 0, whatever the caller's rows hold there
        g_w = torch.where(real, (pg.float() * expert_out[:R].float()).sum(-1), 0.0)
        if recv_weights.shape[0] > R:
            g_w = torch.cat([g_w, g_w.new_zeros(recv_weights.shape[0] - R)])
    return g_eo, g_w
