"""Combine and backward halves of the nccl backend (:class:`NcclCombine`, a part of
:class:`tritonep.backends.nccl.backend.NcclEP` with its own state: the row layouts of every combine wire).

Combine: every receiving rank reduces its rows per (token, source rank) into one partial (fp32 sums, rounded to
the combine wire), the partials go back with one ``all_to_all_single`` and the source sums them in a fixed order
(:mod:`tritonep.backends.nccl.pack`). The dispatch backward is the same path unweighted, carrying the per-route weight
gradients back in the same rows; the combine backward moves ``grad_y`` forward along the dispatch's packets
(:mod:`tritonep.backends.nccl.unpack`). Per call on the GPU: the output and two row buffers allocated, two launches, one
collective (two with the refused flags below: every call); nothing read on the host.

A forward combine and both backward passes also gather one int32 per rank (one more small collective, every rank,
every call): 1 for a rank that takes part as refused (its input was refused, or it cancelled the call:
:meth:`tritonep.backends.nccl.backend.NcclEP.combine_refused`,
:meth:`tritonep.backends.nccl.backend.NcclEP.dispatch_bwd_refused`,
:meth:`tritonep.backends.nccl.backend.NcclEP.combine_bwd_refused`; its partial or gradient rows are NaN bytes, it
computes none). An eager combine (a synced dispatch's handle) reads the gathered flags on the host (one read) and raises
PeerInputError naming the refused ranks on every rank (:meth:`NcclCombine.refusals`); a sync-free combine and every
backward pass read nothing: the refusal is merged into the backend's pending flags (the next ``check()`` or
synced dispatch raises it everywhere) and the combine's output is NaN on every rank (a backward pass's: every
element computed from a refused rank's rows; the rest is exact).
"""

from __future__ import annotations

import torch

from ...wire.formats import get_wire
from .collectives import all_gather_flat, all_to_all_rows
from .pack import local_partials, sum_partials
from .route import SendLayout, send_layout

__all__ = ["NcclCombine"]


class NcclCombine:
    """Combine, dispatch backward and combine backward of one nccl buffer (see the module docstring).

    Args:
        cfg: the buffer's :class:`tritonep.ep.config.EPConfig`. group: the EP group. device: the rank's device.
        launch: the backend's :class:`tritonep.runtime.launch.Launch`. unpacker: its
            :class:`tritonep.backends.nccl.unpack.Unpacker` (the combine backward's row moves). pending: the
            backend's int32 ``[W]`` refused-combine flags nobody read yet (the sync-free combines OR theirs in:
            :meth:`refusals`).
    """

    def __init__(self, cfg, group, device: torch.device, launch, unpacker, pending: torch.Tensor):
        self.cfg, self.group, self.device, self._launch, self._unpacker = cfg, group, device, launch, unpacker
        self._pending = pending
        # a combine's refused flag and every rank's (persistent: made here, normal tensors also for a buffer used
        # in inference mode)
        flag = torch.tensor([0, 1], dtype=torch.int32, device=device)
        self._cflag_ok, self._cflag_bad = flag[:1], flag[1:]  # what a good / a refused rank sends (no op per call)
        self._cflags = torch.zeros(cfg.world_size, dtype=torch.int32, device=device)
        self._cuda = device.type == "cuda"
        H, K, es = cfg.hidden, cfg.topk, torch.empty(0, dtype=cfg.dtype).element_size()
        # combine rows per (wire, carries weight gradients): (format, send layout, fp32 partial layout)
        part = SendLayout(4 * H, 4 * H, 4 * H)
        cf = get_wire(cfg.combine_wire)
        self._rows = {
            (cfg.combine_wire, False): (cf, send_layout(cf.row_bytes(H) if cf.quantized else H * es, K, 0), part),
            ("bf16", False): (get_wire("bf16"), send_layout(H * es, K, 0), part),
            ("bf16", True): (get_wire("bf16"), send_layout(H * es, K, K), part),
        }

    def combine(self, eo, handle, weighted, ut: bool, gw=None, wire="bf16", bad: bool = False):
        """Partials (+ per-route scalars ``gw[row]``) back to the sources; returns ``(y [T, H], gtw [T, K] | None)``.

        Args:
            eo: ``[R', H]`` bfloat16 contiguous, ``R' >= R`` (expert outputs or their gradient).
            handle: the dispatch's handle; weighted: multiply by the route weights (combine) or not (backward).
            ut: the Triton kernels (else their torch twins).
            gw: float32 ``[R]`` per-row scalars to return per route (dispatch backward), or None.
            wire: "bf16" moves the partial rounded to bf16; a quantized wire quantizes the fp32 partial (its twin).
            bad: this rank takes part as refused (NaN partial rows; a forward combine then sets its flag in
                :meth:`refusals`).
        """
        K, H, dev, bf = self.cfg.topk, self.cfg.hidden, self.device, self.cfg.dtype
        T = handle.num_tokens
        ss, rs = handle.send_splits, handle.recv_splits
        Ns, Nr = handle.num_send, handle.num_recv
        fmt, lay, part_lay = self._rows[(wire, gw is not None)]
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
        all_to_all_rows(back, send, rs, ss, self.group)
        y = torch.empty(T, H, dtype=bf, device=dev)
        gtw = None if gw is None else torch.empty(T, K, dtype=torch.float32, device=dev)
        if not fmt.quantized:  # partials in bf16, widened to fp32 by the sum
            sum_partials(self._launch, back, bf, lay.width // 2, handle.pkt, y, ut, T, H, K, Ns, lay, gtw)
        else:  # dequantized straight to fp32
            sum_partials(self._launch, fmt.dequantize_rows(back, H, torch.float32), torch.float32, H, handle.pkt, y,
                         ut, T, H, K, Ns)
        return y, gtw

    def refusals(self, y, bad: bool, read: bool, record_own: bool):
        """Every rank's refused flag of a forward combine whose output is ``y``, or of a dispatch backward (``y``
        None) (one ``all_gather`` of an int32, every rank; ``bad``: this rank's is set). ``read`` (an eager
        combine): returns the flags on the host (a list of ``W`` ints: one read, the caller raises); else None, and
        the output ``y`` is NaN when any rank refused and the flags are merged into the pending flags on the device
        (``record_own`` False: a refused rank whose peers raise in this call does not keep them). ``y`` None: no
        fill, the refused rank's NaN rows already make every output element computed from them NaN (the others do
        not depend on it: exact), two torch calls fewer."""
        all_gather_flat(self._cflags, self._cflag_bad if bad else self._cflag_ok, self.group)
        if read:
            return self._cflags.tolist()
        if bad and not record_own:
            return None
        if y is not None:
            y.masked_fill_(self._cflags.any(), float("nan"))  # no host read: the output cannot pass for a result
        self._pending.bitwise_or_(self._cflags)  # read by the next check() / synced dispatch
        return None

    def combine_bwd(self, grad_y, expert_out, handle, ut: bool, bad: bool = False):
        """grad_expert_out[row] = bf16(w * grad_y[t]); grad_recv_w[row] = <grad_y[t], expert_out[row]> (fp32).

        grad_y always moves as bf16 (whatever the wires), as on the triton backend.

        Args:
            grad_y: ``[T, H]`` bfloat16 contiguous; expert_out: ``[R', H]`` bfloat16 contiguous (``R' >= R``);
            ut: the Triton kernels (else their torch twins).
            bad: this rank takes part as refused (``grad_y`` / ``expert_out`` unused): the same collective with
                all-ones (NaN) bf16 rows, nothing computed; returns None (the refused flag: :meth:`refusals`).

        Returns:
            ``(grad_expert_out [R', H] bfloat16 (rows past R and padding rows zero), grad_recv_w float32 [R]
            (0 on padding rows))``.
        """
        dev, H, bf = self.device, self.cfg.hidden, self.cfg.dtype
        ss, rs = handle.send_splits, handle.recv_splits
        Ns, Nr = handle.num_send, handle.num_recv
        send = torch.empty(Ns, H, dtype=bf, device=dev)
        recv = torch.empty(Nr, H, dtype=bf, device=dev)
        if bad:  # all-ones bytes: NaN in bf16; the peers' rows computed from them are NaN
            send.view(torch.int16).fill_(-1)
            all_to_all_rows(recv, send, ss, rs, self.group)
            return None
        R, R2, T = handle.num_recv_rows, expert_out.shape[0], handle.num_tokens
        dense = R2 == R and self.cfg.expert_alignment == 1  # every row is some route's: nothing to zero
        if R is None:  # a sync-free handle: its dispatch returned max_recv_tokens rows, the tail's gradients are 0
            R = self.cfg.max_recv_tokens
        if Ns and T:  # (a sync-free handle has W * Tcap send slots even without tokens)
            self._unpacker.pack_rows(grad_y, handle.pkt, send, T, ut)
        all_to_all_rows(recv, send, ss, rs, self.group)
        g_eo = (torch.empty if dense else torch.zeros)(R2, H, dtype=bf, device=dev)
        g_w = (torch.empty if dense else torch.zeros)(R, dtype=torch.float32, device=dev)
        if Nr:
            self._unpacker.grad_expand(recv, expert_out, handle.recv_rows, handle.recv_w, g_eo, g_w, Nr, ut)
        return g_eo, g_w
