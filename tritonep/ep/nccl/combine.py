"""Combine and backward halves of the nccl backend (a mixin of :class:`tritonep.ep.nccl.backend.NcclEP`).

Combine: every receiving rank reduces its rows per (token, source rank) into one partial (fp32 sums, rounded to
the combine wire), the partials go back with one ``all_to_all_single`` and the source sums them in a fixed order
(:mod:`tritonep.ep.nccl.pack`). The dispatch backward is the same path unweighted, carrying the per-route weight
gradients back in the same rows; the combine backward moves ``grad_y`` forward along the dispatch's packets
(:mod:`tritonep.ep.nccl.unpack`). Per call on the GPU: the output and two row buffers allocated, two launches, one
collective (two for a combine and a dispatch backward: the refused flags below); nothing read on the host.

A forward combine and a dispatch backward also gather one int32 per rank (one more small collective, every rank,
every call): 1 for a rank that takes part as refused (its input was refused, or it cancelled the call:
:meth:`combine_refused`, :meth:`dispatch_bwd_refused`; its partial rows are NaN bytes, it computes none). An eager
combine (a synced dispatch's handle) reads the gathered flags on the host (one read) and raises PeerInputError naming
the refused ranks on every rank; a sync-free combine and every dispatch backward read nothing: the refusal is merged
into the status word (the next :meth:`check` or synced dispatch raises it everywhere) and the combine's output is NaN
on every rank (a dispatch backward's: every element computed from a refused rank's rows; the rest is exact).
"""

from __future__ import annotations

import torch

from ...errors import BackendError, BufferStateError
from ..status import STATUS_COMBINE_REFUSED
from .collectives import all_gather_flat
from .pack import local_partials, sum_partials

__all__ = ["NcclCombine"]


class NcclCombine:
    """Combine / backward methods of :class:`tritonep.ep.nccl.backend.NcclEP` (uses its attributes: ``K``, ``H``,
    ``device``, ``dtype`` (bfloat16: expert outputs and gradients have it), ``combine_wire``, ``use_triton``,
    ``closed``, ``rank``, ``A``, ``_cuda``, ``_launch``, ``_unpacker``, ``_combine_rows``, ``_a2a``)."""

    def _combine(self, eo, handle, weighted, gw=None, wire="bf16", bad=False, read=False, record_own=True):
        """Partials (+ per-route scalars ``gw[row]``) back to the sources; returns ``(y [T, H], gtw [T, K] | None)``.

        Args:
            eo: ``[R', H]`` bfloat16 contiguous, ``R' >= R`` (expert outputs or their gradient).
            handle: the dispatch's handle; weighted: multiply by the route weights (combine) or not (backward).
            gw: float32 ``[R]`` per-row scalars to return per route (dispatch backward), or None.
            wire: "bf16" moves the partial rounded to bf16; a quantized wire quantizes the fp32 partial (its twin).
            bad: this rank takes part as refused (NaN partial rows, the flag set); read / record_own: see
                :meth:`_combine_flags` (``read``: eager forward combines only; a dispatch backward gathers the flags
                too, reads nothing and records a refusal for the next read).
        """
        if self.closed:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is closed")
        K, H, dev, ut, bf = self.cfg.topk, self.cfg.hidden, self.device, self.use_triton, self.cfg.dtype
        T = handle.num_tokens
        ss, rs = handle.send_splits, handle.recv_splits
        Ns, Nr = handle.num_send, handle.num_recv
        fmt, lay, part_lay = self._combine_rows[(wire, gw is not None)]
        send = torch.empty(Nr, lay.width, dtype=torch.uint8, device=dev)
        if bad:  # a refused rank: all-ones bytes are NaN in every wire's payload and scales (bf16, fp32, e4m3, e8m0)
            send.fill_(255)
        elif not fmt.quantized:  # the kernel writes the rounded partials (and the scalars) straight into the send rows
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
        self._combine_flags(y if weighted else None, bad, read, record_own)
        return y, gtw

    def _combine_flags(self, y, bad: bool, read: bool, record_own: bool):
        """Every rank's refused flag of this combine (one ``all_gather`` of an int32, every rank). ``read`` (an
        eager combine): the host reads them and raises PeerInputError naming the refused ranks (a refused rank
        raises its own error instead); else the output ``y`` is NaN when any rank refused and the refusal is merged
        into the status word on the device (``record_own`` False: a refused rank whose peers raise in this call does
        not keep it either). ``y`` None (a dispatch backward): no fill, the refused rank's NaN rows already make every
        output element computed from them NaN (the others do not depend on it: exact), two torch calls fewer."""
        W = self.cfg.world_size
        all_gather_flat(self._cflags, self._cflag_bad if bad else self._cflag_ok, self.group)
        if read:
            self.host_reads += 1
            flags = self._cflags.tolist()
            refused = [r for r in range(W) if flags[r]]
            if refused and not bad:
                self._raise_pending(flags, "combine")
            return
        if bad and not record_own:
            return
        if y is not None:
            y.masked_fill_(self._cflags.any(), float("nan"))  # no host read: the output cannot pass for a result
        self._cpending.bitwise_or_(self._cflags)  # read by the next check() / synced dispatch (_raise_pending)

    def _raise_pending(self, flags: list, what: str):
        """Raise (once: the flags are cleared) the refused combine the pending flags ``flags`` (host, ``[W]``)
        record: PeerInputError naming the ranks that took part as refused."""
        self._cpending.zero_()
        W = self.cfg.world_size
        refused = [r for r in range(W) if flags[r]]
        self._raise_status([STATUS_COMBINE_REFUSED, refused[0], 1, 0] + [0] * W + [1 if f else 0 for f in flags],
                           what)

    def combine_refused(self, kind=None, record_own=True, handle=None):
        """Take part in this call's combine as refused (:meth:`tritonep.EPBuffer.cancel_combine`): the same
        collectives as the peers' combine, NaN partial rows, the refused flag set. ``handle``: the call's handle on
        this rank, or None (the latest dispatch's: the split sizes must be the peers')."""
        if handle is None:
            handle = self._last_handle() if self._last_handle is not None else None
        if handle is None:
            raise BackendError(f"rank {self.rank}: no dispatch handle to cancel the combine of (the nccl backend needs "
                               f"the dispatch's split sizes to take part); pass the handle")
        self._combine(self.expert_out_buffer(), handle, weighted=True, wire=self.combine_wire, bad=True,
                      record_own=record_own)

    def combine_fwd(self, expert_out, handle, kind=None, read=False):
        """``y [T, H]`` over the combine wire (``kind`` is ignored: there is one combine on this backend).

        Args:
            expert_out: ``[R', H]`` bfloat16 contiguous, ``R' >= R``; handle: the dispatch's handle.
            read: an eager combine (:meth:`_combine_flags`).
        """
        y, _ = self._combine(expert_out, handle, weighted=True, wire=self.combine_wire, read=read)
        return y

    def dispatch_bwd_refused(self, handle=None, with_weights=False):
        """Take part in this call's dispatch backward as refused (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`):
        the peers' collectives with NaN rows and the refused flag set (every element of their outputs computed from
        this rank's rows is NaN, the refusal is recorded for the next read on every rank, this one included).
        ``handle``: the dispatch's handle, or None (the latest)."""
        if handle is None:
            handle = self._last_handle() if self._last_handle is not None else None
        if handle is None:
            raise BackendError(f"rank {self.rank}: no dispatch handle to cancel the dispatch backward of (the nccl "
                               f"backend needs the dispatch's split sizes to take part); pass the handle")
        self._combine(self.expert_out_buffer(), handle, weighted=False, gw=self._no_w if with_weights else None,
                      bad=True)

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
