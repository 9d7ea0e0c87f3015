"""The one-launch decode paths of the triton backend (geometry ``decode > 0``, small ``max_tokens_per_rank``).

:class:`DecodePath` is a mixin of :class:`tritonep.backends.triton.backend.TritonEP` (it uses the backend's config,
bound kernels, handle layout and :class:`tritonep.backends.triton.outputs.DispatchOutputs`):

* forward dispatch = ONE launch of :func:`tritonep.backends.triton.kernels.decode_dispatch.dispatch_decode_kernel` (counts exchange,
  layout, send, wait, expand, the handle's copy of the routing; it advances the call counters itself). The outputs
  are allocated for ``max_recv_tokens`` rows before the launch; with sync checks on (eager) the one host read of the
  status word waits for the launch to publish it into pinned host memory (:class:`tritonep.runtime.host_status.
  HostStatus`: no device-to-host copy, no event) and the outputs are cut to the rows received (the same shapes and
  bits as the two-kernel path); refused calls raise the same typed errors after the launch, on every rank.
* push combine = ONE launch of :func:`tritonep.backends.triton.kernels.decode_combine.combine_decode_kernel` (no torch op
  advances the combine counter first): the weighted combine, and the dispatch backward (unweighted, with the
  weight gradients' return when asked).

Every rank makes the same launch with the same grid whatever its T (0 included) or input validity (docs/protocols.md, host protocol rule).
"""

from __future__ import annotations

import torch

__all__ = ["DecodePath"]


class DecodePath:
    """Forward dispatch and push combine (weighted, or the dispatch backward) as one launch each (see the module docstring)."""

    def _dispatch_decode(self, x, topk_idx, topk_weights, sync, keep_quantized, bad_input, T):
        """Forward dispatch in one launch (``T`` tokens); returns what ``TritonEP.dispatch_fwd`` returns and raises
        what it raises (CapacityError / PeerInputError / InputError / PeerTimeoutError when ``sync``). The handle
        block and the rows come as ONE set of the pool shared by the buffers of this shape (:mod:`tritonep.runtime.pool`:
        ``(store, rows, row weights, ntpe, offs)``), or are allocated (graph capture, every set held)."""
        max_recv = self.cfg.max_recv_tokens
        # rows are known on the host only after the launch: the outputs hold the capacity, cut to R after the host
        # read (the kernel zeroes the row weights past the rows received: no memset before the launch; they are the
        # handle storage's field ``rw``)
        got = self._dpool.take()
        if got is not None:
            store, out, rw, ntpe, offs = got
        else:
            store = self.hl.new(self.device)
        if keep_quantized or got is None:  # quantized rows (never pooled), or the pool's rows were not to be had
            out, q, sc = self._alloc_rows(max_recv, keep_quantized)
        else:
            q = sc = None
        ticket = self.host_status.ticket(sync)  # only a read takes one (HostStatus.next_ticket says why)
        self.k.decode(q is not None)(x, topk_idx, topk_weights, store, T, int(bad_input), max_recv, out, q, sc, ticket)
        # what needs no verdict is made while the launch runs (the host read waits for it anyway)
        if got is None:
            hl = self.hl
            ntpe, offs, rw = hl.tensor(store, "ntpe"), hl.tensor(store, "offs"), hl.tensor(store, "rw")
        handle = self._new_handle()
        st = self._read_host_status(ticket) if sync else None  # published once the verdict is known
        code, refused, R = self._verdict(st)
        if R is not None:
            out_w = rw[:R]
            if q is None:
                out = out[:R]
            else:
                q, sc = q[:R], sc[:R]
        elif got is not None:  # sync-free: fresh views, never the pooled tensors themselves (autograd would mark
            out_w = rw[:max_recv]  # them, and the marks would outlive this call)
            if q is None:
                out = out[:max_recv]
        else:
            out_w = rw
        return self._finish_dispatch(code, refused, st, sync, bad_input, out, out_w, q, sc, handle, store, T, ntpe,
                                     offs, R)

    def _combine_decode(self, eo, handle, wire, weighted=True, gw=None):
        """Push combine in one launch: ``(y [T, H] (eo's dtype), gtw)``; ``weighted=False`` is the dispatch
        backward, whose ``gw [R]`` float32 (or None) comes back per route as ``gtw [T, K]`` float32 (else None)."""
        T = handle.num_tokens
        if weighted:  # the forward combine: its output pooled (pool.py)
            got = self._ypool.take()
            y = got[0][:T] if got is not None else torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
            self.k.combine_decode(wire, True, False)(eo, handle.store, y, T, self._no_w, y)
            self._eager_check("combine")
            return y, None
        y = torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
        gtw = torch.empty(T, self.cfg.topk, dtype=torch.float32, device=self.device) if gw is not None else None
        self.k.combine_decode(wire, False, gw is not None)(eo, handle.store, y, T, self._no_w if gw is None else gw,
                                                          y if gtw is None else gtw)
        self._eager_check("dispatch backward")
        return y, gtw
