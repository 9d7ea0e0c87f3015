"""The staged paths of the triton backend: a call as several launches, each a stage of the protocol (the two-kernel
and fused tiles' dispatch and combine, and the combine backward on every tiles).

:class:`StagedPath` is a part of :class:`tritonep.backends.triton.backend.TritonEP`, one of its two paths (the other,
:class:`tritonep.backends.triton.decode.DecodePath`, makes the decode tiles' dispatch and push combine ONE launch each;
both answer ``dispatch`` and ``combine`` alike). It launches through the backend's bound kernels
(:class:`tritonep.backends.triton.calls.KernelSet`), reads the verdict through its
:class:`tritonep.backends.triton.status.CallStatus` and allocates through its
:class:`tritonep.backends.triton.outputs.DispatchOutputs`.

Call sequence of a dispatch (all on the current stream, no host sync except the one optional status read after the
counts exchange, see ``sync``):

1. chunk histograms; the same launch writes the handle's own sanitized copy of the routing (ids outside
   ``[-1, E)`` become -1) and advances ``calls[CALL_DISPATCH]`` / ``calls[CALL_EXCHANGE]`` on the device,
2. counts exchange + layout (one program per expert block); its last program publishes (status, rows received)
   and the call's ticket into pinned host memory (:class:`tritonep.runtime.host_status.HostStatus`),
3. [synced calls only] one host read of (status, rows): a spin on the published ticket, no device-to-host copy or
   event -> CapacityError / PeerInputError / PeerTimeoutError before any row moves (the send is queued before the
   host waits, so its NVLink time overlaps the read),
4. send, 5. expand (or 4+5 as one launch when the tiles have ``fused_send > 0``: sends and expands overlap).

Combine: partial (push into the source, or into own memory for pull), output (a weighted push combine runs both
as one launch when the tiles have ``fused_combine``); the call's last launch advances ``calls[CALL_COMBINE]``
itself (no host op). The combine backward is a dispatch of the gradient rows: send, then the expand, which
advances ``calls[CALL_DISPATCH]`` itself. Combine and both backward passes read the routing from the handle (its
copy), never from the caller's tensors. Every flag row, counter and status field is named in
:mod:`tritonep.device.protocol`; every rank makes the same launches whatever its T (0 included) or input validity
(docs/protocols.md, host protocol rule).
"""

from __future__ import annotations

import torch

from .calls import one_pass_combine

__all__ = ["StagedPath"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class StagedPath:
    """Forward dispatch, combine (weighted, or the dispatch backward) and the combine backward as a few launches each
    (see the module docstring).

    Args:
        cfg: the buffer's config (its kernel tiles, ``hidden``, ``topk``, ``dtype``, ``max_recv_tokens``). kernels:
            its :class:`tritonep.backends.triton.calls.KernelSet`. status: its
            :class:`tritonep.backends.triton.status.CallStatus`. outputs: its
            :class:`tritonep.backends.triton.outputs.DispatchOutputs`. device: the rank's device. no_w: a float32
            ``[1]`` tensor for an unused ``gw_ptr`` (the weighted combine's).
    """

    def __init__(self, cfg, kernels, status, outputs, device: torch.device, no_w: torch.Tensor):
        self.cfg, self.k, self.status, self.outputs, self.device = cfg, kernels, status, outputs, device
        self.hl, self._no_w = outputs.hl, no_w

    def dispatch(self, x, topk_idx, topk_weights, sync, keep_quantized, bad_input, T, count=None):
        """Forward dispatch of ``T`` tokens (launches 1-5 of the module docstring); returns what
        ``TritonEP.dispatch_fwd`` returns and raises what it raises (CapacityError / PeerInputError / InputError /
        PeerTimeoutError when ``sync``). The handle storage comes from the outputs part's pool (or is allocated:
        graph capture, every set held). ``count``: the count routing, as
        :meth:`tritonep.backends.triton.decode.DecodePath.dispatch` (exchanged by the counts exchange here)."""
        g, outs, k, status = self.cfg.tiles, self.outputs, self.k, self.status
        # the pool's set (store, ntpe, offs, row weights), or a fresh store (graph capture, every set held)
        store, ntpe, offs, rw = outs.take()
        nc = _cdiv(T, g.bt)
        ticket = status.ticket(sync)  # only a read takes one (HostStatus.next_ticket says why)
        k.hist(topk_idx, topk_weights, store, T, nc)
        if count is None:
            k.exchange(nc, store, int(bad_input), ticket)  # publishes status + ticket to the host
        else:  # with the count routing's sums, published before the status words
            k.exchange_count(count[3], count[1])(nc, store, int(bad_input), ticket, count[0], count[2])
        fused = g.fused_send > 0
        if not fused:
            k.send(x, store, T, nc)  # queued before the host waits: its NVLink time overlaps the read
        # while the exchange runs: what needs no verdict (between the read and the data launch the GPU may wait for
        # the host). Row weights: a synced call (R known after the read) -> the handle storage's field (written
        # whole by the data kernels: no allocation); sync-free (no read) -> max_recv_tokens zeros (the rows past
        # the received ones stay 0)
        if ntpe is None:
            ntpe, offs = self.hl.tensor(store, "ntpe"), self.hl.tensor(store, "offs")
        w_arg = self.hl.field_view(store, "rw") if sync else \
            torch.zeros(self.cfg.max_recv_tokens, dtype=torch.float32, device=self.device)
        handle = outs.new_handle()
        st = status.read(ticket) if sync else None  # the exchange's last program published it
        code, refused, R = status.verdict(st)
        nrows = R if R is not None else self.cfg.max_recv_tokens
        out, q, sc = outs.alloc_rows(nrows, keep_quantized)
        # the data kernels run on every rank whatever the verdict (a refused call's kernels move no row: the
        # exchange recorded this dispatch's number in status[ST_SKIP_CALL]), so the flags advance identically; they
        # write no row at or past ``nrows`` (the rows just allocated), whatever the layout says
        kq = q is not None
        if fused:
            k.fused(kq)(x, store, T, out, w_arg, q, sc, nrows)
        else:
            k.expand(kq)(x, out, w_arg, store, out, w_arg, q, sc, nrows)
        # while the data kernels run: the weights' view (a fresh slice of the pooled field, never the field itself)
        out_w = w_arg if R is None else rw[:R] if rw is not None else self.hl.tensor(store, "rw", R)
        status.finish(refused, st, sync, bad_input)
        sums = k.count_sums(count, st is not None)
        return outs.finish(handle, store, T, R, out, out_w, q, sc, ntpe, offs, sums)

    def combine(self, eo, handle, wire, weighted=True, gw=None, bad=0, ticket=0, kind="push"):
        """A combine (``weighted``: ``(y [T, H] (eo's dtype), None)``) or the dispatch backward (``(y, gtw)``: with
        ``gw [R]`` float32 the weight gradients come back per route as ``gtw [T, K]`` float32, push only; else None),
        ``kind`` push or pull. ``bad`` / ``ticket``: as ``TritonEP._combine`` (a refused rank; the host's read of an
        eager combine)."""
        g, status = self.cfg.tiles, self.status
        T, store, k = handle.num_tokens, handle.store, self.k
        y = torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
        what = "combine" if weighted else "dispatch backward"
        wgrad = gw is not None
        direct = one_pass_combine(self.cfg, wire, kind, wgrad)  # world 1, bf16 rows, raw wire, push, no wgrad
        if g.fused_combine and kind == "push" and weighted and not wgrad:
            k.combine_fused(wire, direct)(eo, store, y, T, bad, ticket)
            status.after_combine(ticket, bad, what)
            return y, None
        if direct:
            k.partial(kind, weighted, False, wire, True)(eo, store, self._no_w, bad, y)
            k.out(kind, False, wire, True)(store, y, T, _cdiv(T, g.cbt), y, ticket)
            status.after_combine(ticket, bad, what)
            return y, None
        k.partial(kind, weighted, wgrad, wire)(eo, store, gw if wgrad else self._no_w, bad)
        gtw = torch.empty(T, self.cfg.topk, dtype=torch.float32, device=self.device) if wgrad else None
        k.out(kind, wgrad, wire)(store, y, T, _cdiv(T, g.cbt), gtw if wgrad else y, ticket)
        status.after_combine(ticket, bad, what)
        return y, gtw

    def combine_bwd(self, grad_y, expert_out, handle):
        """The combine backward: ``(grad_expert_out [R, H], grad_recv_w [R] float32)`` with ``grad_expert_out[row] =
        w * grad_y[t]`` and ``grad_recv_w[row] = <grad_y[t], expert_out[row]>`` (the gradient rows' send, then the
        expand on the expert rank, on every tiles)."""
        R, H, dev = expert_out.shape[0], self.cfg.hidden, self.device
        # no zero fill: the expand writes every row (routes; alignment padding and rows past the layout's end, read
        # from the handle's segment sizes / offsets on the device, as zeros)
        g_eo = torch.empty(R, H, dtype=self.cfg.dtype, device=dev)
        g_w = torch.empty(R, dtype=torch.float32, device=dev)
        T, store, k = handle.num_tokens, handle.store, self.k
        # grad_y is held until the expand ran: it reads the own rank's rows from it (raw wire)
        k.send_bwd(grad_y, store, T, _cdiv(T, self.cfg.tiles.bt))
        k.expand_bwd(grad_y, g_eo, store, expert_out, g_w, g_w, R)
        self.status.eager_check("combine backward")
        return g_eo, g_w
