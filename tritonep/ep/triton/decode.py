"""The one-launch decode paths of the triton backend (geometry ``decode > 0``, small ``max_tokens_per_rank``).

:class:`DecodePath` is a mixin of :class:`tritonep.ep.triton.backend.TritonEP` (it uses the backend's config,
bound kernels, handle layout and :class:`tritonep.ep.triton.outputs.DispatchOutputs`):

* forward dispatch = ONE launch of :func:`tritonep.kernels.decode_dispatch.dispatch_decode_kernel` (counts exchange,
  layout, send, wait, expand, the handle's copy of the routing; it advances the call counters itself). The outputs
  are allocated for ``max_recv_tokens`` rows before the launch; with sync checks on (eager) the one host read of the
  status word waits for the launch to publish it into pinned host memory (:class:`tritonep.ep.triton.host_status.
  HostStatus`: no device-to-host copy, no event) and the outputs are cut to the rows received (the same shapes and
  bits as the two-kernel path); refused calls raise the same typed errors after the launch, on every rank.
* push combine = ONE launch of :func:`tritonep.kernels.decode_combine.combine_decode_kernel` (no torch op
  advances the combine counter first): the weighted combine, and the dispatch backward (unweighted, with the
  weight gradients' return when asked).

Every rank makes the same launch with the same grid whatever its T (0 included) or input validity (docs/protocols.md, host protocol rule).
"""

from __future__ import annotations

import torch

__all__ = ["DecodePath"]


class DecodePath:
    """Forward dispatch and push combine (weighted, or the dispatch backward) as one launch each (see the module docstring)."""

    def _dispatch_decode(self, x, topk_idx, topk_weights, sync, keep_quantized, bad_input, got, key):
        """Forward dispatch in one launch; returns what ``TritonEP.dispatch_fwd`` returns and raises what it raises
        (CapacityError / PeerInputError / InputError / PeerTimeoutError when ``sync``). ``got``: a set of the output
        pool (:mod:`tritonep.ep.pool`: ``(store, ntpe, offs, row weights)``), or None: allocate; the rows come
        from the pool shared by the buffers of this shape (or are allocated); ``key``: the call's
        :meth:`tritonep.ep.pool.OutputPool.stream_key` (None: nothing pooled)."""
        T = x.shape[0]
        max_recv = self.cfg.max_recv_tokens
        hl = self.hl
        # rows are known on the host only after the launch: the outputs hold the capacity, cut to R after the host
        # read (the kernel zeroes the row weights past the rows received: no memset before the launch; they are the
        # handle storage's field ``rw``)
        if got is not None:
            store, ntpe, offs, rw = got
        else:
            store = hl.new(self.device)
        rows = None if keep_quantized else self._rpool.take(key)  # the shared pool's [max_recv, H] block, or None
        if rows is not None:
            out, q, sc = rows[0], None, None
        else:
            out, q, sc = self._alloc_rows(max_recv, keep_quantized)
        ticket = self.host_status.ticket(sync)  # only a read takes one (HostStatus.next_ticket says why)
        self.k.decode(q is not None)(x, topk_idx, topk_weights, store, T, int(bad_input), max_recv, out, q, sc, ticket)
        # what needs no verdict is made while the launch runs (the host read waits for it anyway)
        if got is None:
            ntpe, offs, rw = hl.tensor(store, "ntpe"), hl.tensor(store, "offs"), hl.tensor(store, "rw")
        handle = self._new_handle(store, T)
        st = self._read_host_status(ticket) if sync else None  # published once the verdict is known
        code, refused, R = self._verdict(st)
        if R is not None:
            out, out_w = (out if q is not None else out[:R]), rw[:R]
            if q is not None:
                q, sc = q[:R], sc[:R]
        else:  # sync-free: fresh views, never the pooled tensors themselves (autograd would mark them, and the marks
            out = out[:max_recv] if rows is not None else out  # would outlive this call)
            out_w = rw[:max_recv] if got is not None else rw
        return self._finish_dispatch(code, refused, st, sync, bad_input, out, out_w, q, sc, handle, ntpe, offs, R)

    def _combine_decode(self, eo, handle, wire, weighted=True, gw=None):
        """Push combine in one launch: ``(y [T, H] (eo's dtype), gtw)``; ``weighted=False`` is the dispatch
        backward, whose ``gw [R]`` float32 (or None) comes back per route as ``gtw [T, K]`` float32 (else None)."""
        T = handle.num_tokens
        got = self._ypool.take() if weighted else None  # the forward combine's output: pooled (pool.py)
        y = got[0][:T] if got is not None else torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
        gtw = torch.empty(T, self.cfg.topk, dtype=torch.float32, device=self.device) if gw is not None else None
        self.k.combine_decode(wire, weighted, gw is not None)(eo, handle.store, y, T,
                                                              self._no_w if gw is None else gw,
                                                              y if gtw is None else gtw)
        self._eager_check("combine" if weighted else "dispatch backward")
        return y, gtw
