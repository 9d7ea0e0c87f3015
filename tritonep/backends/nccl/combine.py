"""Combine and backward halves of the nccl backend (a mixin of :class:`tritonep.backends.nccl.backend.NcclEP`).

Combine: every receiving rank reduces its rows per (token, source rank) into one partial (fp32 sums, rounded to
the combine wire), the partials go back with one ``all_to_all_single`` and the source sums them in a fixed order
(:mod:`tritonep.backends.nccl.pack`). The dispatch backward is the same path unweighted, carrying the per-route weight
gradients back in the same rows; the combine backward moves ``grad_y`` forward along the dispatch's packets
(:mod:`tritonep.backends.nccl.unpack`). Per call on the GPU: the output and two row buffers allocated, two launches, one
collective; nothing read on the host.
"""

from __future__ import annotations

import torch

from ...errors import BufferStateError
from .pack import local_partials, sum_partials

__all__ = ["NcclCombine"]


class NcclCombine:
    """Combine / backward methods of :class:`tritonep.backends.nccl.backend.NcclEP` (uses its attributes: ``K``, ``H``,
    ``device``, ``dtype`` (bfloat16: expert outputs and gradients have it), ``combine_wire``, ``use_triton``,
    ``closed``, ``rank``, ``A``, ``_cuda``, ``_launch``, ``_unpacker``, ``_combine_rows``, ``_a2a``)."""

    def _combine(self, eo, handle, weighted, gw=None, wire="bf16"):
        """Partials (+ per-route scalars ``gw[row]``) back to the sources; returns ``(y [T, H], gtw [T, K] | None)``.

        Args:
            eo: ``[R', H]`` bfloat16 contiguous, ``R' >= R`` (expert outputs or their gradient).
            handle: the dispatch's handle; weighted: multiply by the route weights (combine) or not (backward).
            gw: float32 ``[R]`` per-row scalars to return per route (dispatch backward), or None.
            wire: "bf16" moves the partial rounded to bf16; a quantized wire quantizes the fp32 partial (its twin).
        """
        if self.closed:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is closed")
        K, H, dev, ut, bf = self.cfg.topk, self.cfg.hidden, self.device, self.use_triton, self.cfg.dtype
        T = handle.num_tokens
        ss, rs = handle.send_splits, handle.recv_splits
        Ns, Nr = handle.num_send, handle.num_recv
        fmt, lay, part_lay = self._combine_rows[(wire, gw is not None)]
        send = torch.empty(Nr, lay.width, dtype=torch.uint8, device=dev)
        if not fmt.quantized:  # the kernel writes the rounded partials (and the scalars) straight into the send rows
            local_partials(self._launch, eo, handle.recv_rows, handle.recv_w, send, lay, bf, weighted, ut, Nr, H, K,
                           self._cuda, gw)
        else:  # fp32 partials, quantized by the twin (combine wires only: the backward passes move bf16)
            part = torch.empty(Nr, H, dtype=torch.float32, device=dev)
            local_partials(self._launch, eo, handle.recv_rows, handle.recv_w, part, part_lay, torch.float32,
                           weighted, ut, Nr, H, K, self._cuda)
            q, sb = fmt.quantize_bytes(part)
            send[:, :q.shape[1]].copy_(q)
            send[:, q.shape[1]:lay.rb].copy_(sb)
        back = torch.empty(Ns, lay.width, dtype=torch.uint8, device=dev)
        self._a2a(back, send, rs, ss)
        y = torch.empty(T, H, dtype=bf, device=dev)
        gtw = None if gw is None else torch.empty(T, K, dtype=torch.float32, device=dev)
        if not fmt.quantized:  # partials in bf16, widened to fp32 by the sum
            sum_partials(self._launch, back, bf, lay.width // 2, handle.pkt, y, ut, T, H, K, Ns, lay, gtw)
        else:  # dequantized straight to fp32
            sum_partials(self._launch, fmt.dequantize_rows(back, H, torch.float32), torch.float32, H, handle.pkt, y,
                         ut, T, H, K, Ns)
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
            grad_y: ``[T, H]`` bfloat16 contiguous; expert_out: ``[R', H]`` bfloat16 contiguous (``R' >= R``).

        Returns:
            ``(grad_expert_out [R', H] bfloat16 (rows past R and padding rows zero), grad_recv_w float32 [R]
            (0 on padding rows))``.
        """
        if self.closed:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is closed")
        dev, ut, H, bf = self.device, self.use_triton, self.cfg.hidden, self.cfg.dtype
        ss, rs = handle.send_splits, handle.recv_splits
        Ns, Nr = handle.num_send, handle.num_recv
        R, R2, T = handle.num_recv_rows, expert_out.shape[0], handle.num_tokens
        dense = R2 == R and self.cfg.expert_alignment == 1  # every row is some route's: nothing to zero
        if R is None:  # a sync-free handle: its dispatch returned max_recv_tokens rows, the tail's gradients are 0
            R = self.cfg.max_recv_tokens
        send = torch.empty(Ns, H, dtype=bf, device=dev)
        if Ns and T:  # (a sync-free handle has W * Tcap send slots even without tokens)
            self._unpacker.pack_rows(grad_y, handle.pkt, send, T, ut)
        recv = torch.empty(Nr, H, dtype=bf, device=dev)
        self._a2a(recv, send, ss, rs)
        g_eo = (torch.empty if dense else torch.zeros)(R2, H, dtype=bf, device=dev)
        g_w = (torch.empty if dense else torch.zeros)(R, dtype=torch.float32, device=dev)
        if Nr:
            self._unpacker.grad_expand(recv, expert_out, handle.recv_rows, handle.recv_w, g_eo, g_w, Nr, ut)
        return g_eo, g_w
