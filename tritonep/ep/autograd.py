"""Autograd for dispatch and combine (docs/architecture.md).

dispatch: ``(x [T,H], topk_weights [T,K]) -> (recv_x [R,H], recv_weights [R])``; its backward is a combine without
weights (``grad_x[t] = sum_k grad_recv_x[row(t,k)]``) plus a gather of the per-row weight gradients
(``grad_topk_weights[t,k] = grad_recv_weights[row(t,k)]``).

combine: ``(expert_out [R,H], recv_weights [R]) -> y [T,H]``; its backward is a dispatch of ``grad_y`` scaled by the
route weight (``grad_expert_out[row] = w * grad_y[t]``) plus ``grad_recv_weights[row] = <grad_y[t], expert_out[row]>``
computed where the row lives.
"""

from __future__ import annotations

import torch

__all__ = ["DispatchFn", "CombineFn"]


class DispatchFn(torch.autograd.Function):
    """``(x, topk_weights) -> (recv_x, recv_weights, num_tokens_per_expert, expert_offsets)`` through a backend;
    backward = a combine without weights plus the return of the per-row weight gradients (module docstring)."""

    @staticmethod
    def forward(ctx, x, topk_weights, impl, topk_idx, sync, sync_free, box):
        out, out_w, ntpe, offs, handle = impl.dispatch_fwd(x, topk_idx, topk_weights, sync, sync_free=sync_free)
        # autograd refuses in-place ops on a view made inside a custom Function, and the rows may be a cut of a
        # larger block (decode, pooled: tritonep/runtime/pool.py): hand out an alias of its own (no view; same
        # storage, so the pool still sees it held). The row weights stay a view on purpose: combine uses the
        # weights the dispatch moved, so an in-place change of them would change the gradient but not the sum
        if out._base is not None:
            out = out.detach()
        box.append(handle)  # handle.recv_weights is out_w: the very tensor autograd returns (tracked)
        ctx.impl = impl
        ctx.handle = handle
        ctx.mark_non_differentiable(ntpe, offs)
        return out, out_w, ntpe, offs

    @staticmethod
    def backward(ctx, grad_out, grad_out_w, _g1, _g2):
        if grad_out is None:
            cfg = ctx.impl.cfg
            rows = ctx.handle.num_recv_rows
            grad_out = torch.zeros(cfg.max_recv_tokens if rows is None else rows, cfg.hidden, dtype=cfg.dtype,
                                   device=ctx.impl.device)
        gw = grad_out_w.contiguous() if grad_out_w is not None else None  # autograd may hand expanded grads
        grad_x, grad_w = ctx.impl.dispatch_bwd(grad_out.contiguous(), gw, ctx.handle)
        return grad_x, grad_w, None, None, None, None, None


class CombineFn(torch.autograd.Function):
    """``(expert_out, recv_weights) -> y``; backward = a dispatch of ``grad_y`` scaled by the route weights plus
    ``<grad_y, expert_out row>`` per row (module docstring)."""

    @staticmethod
    def forward(ctx, expert_out, recv_weights, impl, handle, kind):
        y = impl.combine_fwd(expert_out, handle, kind=kind)
        if y._base is not None:  # a view of a pooled block (decode, tritonep/runtime/pool.py): autograd refuses
            y = y.detach()  # in-place ops on a view made inside a custom Function; an alias of its own is no view
        ctx.impl = impl
        ctx.handle = handle
        ctx.save_for_backward(expert_out)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (expert_out,) = ctx.saved_tensors
        g_eo, g_w = ctx.impl.combine_bwd(grad_y.contiguous(), expert_out, ctx.handle)
        return g_eo, g_w, None, None, None
