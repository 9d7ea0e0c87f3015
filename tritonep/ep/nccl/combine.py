"""Combine and backward halves of the nccl backend (a mixin of :class:`tritonep.ep.nccl.backend.NcclEP`).

Combine: every receiving rank reduces its rows per (token, source rank) into one partial (fp32 sums, rounded to
the combine wire), the partials go back with one ``all_to_all_single`` and the source sums them in a fixed order
(:mod:`tritonep.ep.nccl.pack`). The dispatch backward is the same path unweighted (optionally carrying per-route
scalars back); the combine backward moves ``grad_y`` forward like a bf16 dispatch.
"""

from __future__ import annotations

import torch

from .pack import gather_rows, local_partials, round_up, sum_partials
from ...wire.formats import get_wire

__all__ = ["NcclCombine"]


class NcclCombine:
    """Combine / backward methods of :class:`tritonep.ep.nccl.backend.NcclEP` (uses its attributes: ``W``, ``K``,
    ``H``, ``L``, ``device``, ``dtype``, ``combine_wire``, ``use_triton``, ``_a2a``,
    ``_check_usable``)."""

    def _combine(self, eo, handle, weighted, gw=None, wire="bf16"):
        """Partials (+ per-route scalars ``gw[row]``) back to the sources; returns ``(y [T, H], gtw [T, K] | None)``.

        Args:
            eo: ``[R', H]`` bfloat16 contiguous, ``R' >= R`` (expert outputs or their gradient).
            handle: the dispatch's handle; weighted: multiply by the route weights (combine) or not (backward).
            gw: float32 ``[R]`` per-row scalars to return per route (dispatch backward), or None.
            wire: "bf16" moves the partial rounded to bf16; a quantized wire quantizes the fp32 partial (its twin).
        """
        self._check_usable()
        K, H, dev = self.K, self.H, self.device
        T = handle.num_tokens
        send_splits, recv_splits = list(handle.send_splits), list(handle.recv_splits)
        Ns, Nr = sum(send_splits), sum(recv_splits)
        rr, rw = handle.recv_rows, handle.recv_w
        fmt = get_wire(wire)
        rb = fmt.row_bytes(H) if fmt.quantized else H * eo.element_size()
        mo = round_up(rb, 8)
        width = round_up(mo + (4 * K if gw is not None else 0), 8)
        send = torch.empty(Nr, width, dtype=torch.uint8, device=dev)
        if not fmt.quantized:  # the kernel writes the rounded partials straight into the send rows
            local_partials(eo, rr, rw, send[:, :rb].view(eo.dtype), weighted, self.use_triton)
        else:
            part = torch.empty(Nr, H, dtype=torch.float32, device=dev)
            local_partials(eo, rr, rw, part, weighted, self.use_triton)
            q, sb = fmt.quantize_bytes(part)
            send[:, :q.shape[1]].copy_(q)
            send[:, q.shape[1]:rb].copy_(sb)
        if gw is not None:
            g = send[:, mo:mo + 4 * K].view(torch.float32)
            if gw.shape[0]:
                g.copy_(torch.where(rr >= 0, gw[rr.clamp(min=0).long()], 0.0))
            else:
                g.zero_()
        back = torch.empty(Ns, width, dtype=torch.uint8, device=dev)
        self._a2a(back, send, recv_splits, send_splits)
        if not fmt.quantized:  # partials in bf16, widened to fp32 by the sum
            pp = back[:, :rb].view(eo.dtype)
        else:  # dequantized straight to fp32
            pp = fmt.dequantize_rows(back, H, torch.float32)
        y = torch.empty(T, H, dtype=eo.dtype, device=dev)
        sum_partials(pp, handle.pos if self.use_triton else None, handle.send_tok, send_splits, y,
                     self.use_triton)
        gtw = None
        if gw is not None:
            gtw = torch.zeros(T, K, dtype=torch.float32, device=dev)
            if T and Ns:
                ids = handle.topk_idx.long()
                dest = torch.where(ids >= 0, torch.div(ids, self.L, rounding_mode="floor"), self.W)
                pos = torch.cat([handle.pos, torch.full((1, T), -1, dtype=torch.int64, device=dev)])
                pkt = pos.gather(0, dest.t()).t()  # [T, K]: packet that carried route (t, k), -1 if masked
                gb = back[:, mo:mo + 4 * K].view(torch.float32)
                gtw = torch.where(pkt >= 0, gb[pkt.clamp(min=0), torch.arange(K, device=dev)], 0.0)
        return y, gtw

    def combine_fwd(self, expert_out, handle, kind=None):
        """``y [T, H]`` over the combine wire (``kind`` is ignored: there is one combine on this backend).

        Args:
            expert_out: ``[R', H]`` bfloat16 contiguous, ``R' >= R``; handle: the dispatch's handle.
        """
        y, _ = self._combine(expert_out, handle, weighted=True, wire=self.combine_wire)
        return y

    # ---------------------------------------------------------------------------------------------- backward
    def dispatch_bwd(self, grad_recv_x, grad_recv_w, handle):
        """grad_x[t] = sum_k grad_recv_x[row(t,k)]; grad_topk_weights[t,k] = grad_recv_w[row(t,k)] (bf16 wire).

        Args:
            grad_recv_x: ``[R, H]`` bfloat16; grad_recv_w: float32 ``[R]`` or None.

        Returns:
            ``(grad_x [T, H] bfloat16, grad_topk_weights float32 [T, K] or None)``.
        """
        return self._combine(grad_recv_x.contiguous(), handle, weighted=False,
                             gw=grad_recv_w.contiguous() if grad_recv_w is not None else None)

    def combine_bwd(self, grad_y, expert_out, handle):
        """grad_expert_out[row] = bf16(w * grad_y[t]); grad_recv_w[row] = <grad_y[t], expert_out[row]> (fp32).

        grad_y always moves as bf16 (whatever the wires), as on the triton backend.

        Args:
            grad_y: ``[T, H]`` bfloat16 contiguous; expert_out: ``[R', H]`` bfloat16 (``R' >= R``).

        Returns:
            ``(grad_expert_out [R', H] bfloat16 (rows past R and padding rows zero), grad_recv_w float32 [R]
            (0 on padding rows))``.
        """
        self._check_usable()
        send_splits, recv_splits = list(handle.send_splits), list(handle.recv_splits)
        Nr = sum(recv_splits)
        R, R2 = handle.num_recv_rows, expert_out.shape[0]
        send = gather_rows(grad_y, handle.send_tok)
        recv = torch.empty(Nr + 1, self.H, dtype=grad_y.dtype, device=self.device)
        recv[Nr].zero_()
        self._a2a(recv[:Nr], send, send_splits, recv_splits)
        gy = gather_rows(recv, handle.row_src)  # [R, H]; padding rows read the zero row
        g_rows = (gy * handle.row_w[:, None]).to(self.dtype)
        dots = (gy.float() * expert_out[:R].float()).sum(-1)
        g_w = torch.where(handle.row_src < Nr, dots, 0.0)
        if R2 == R:
            return g_rows, g_w
        g_eo = torch.zeros(R2, self.H, dtype=self.dtype, device=self.device)
        g_eo[:R] = g_rows
        return g_eo, g_w
