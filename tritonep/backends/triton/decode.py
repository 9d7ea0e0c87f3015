"""The one-launch decode paths of the triton backend (tiles ``decode > 0``, small ``max_tokens_per_rank``).

:class:`DecodePath` is a part of :class:`tritonep.backends.triton.backend.TritonEP`, one of its two paths (the other:
:class:`tritonep.backends.triton.staged.StagedPath`; both answer ``dispatch`` and ``combine`` alike, and a decode
buffer's pull combine and combine backward take the staged launches); its calls take their outputs from the outputs
part's shared pools, and it launches through the backend's bound kernels
(:class:`tritonep.backends.triton.calls.KernelSet`), reads the verdict through its
:class:`tritonep.backends.triton.status.CallStatus` and allocates through its
:class:`tritonep.backends.triton.outputs.DispatchOutputs`:

* forward dispatch = ONE launch of :func:`tritonep.backends.triton.kernels.decode_dispatch.dispatch_decode_kernel`
  (counts exchange, layout, send, wait, expand, the handle's copy of the routing; it advances the call counters
  itself). The outputs are allocated for ``max_recv_tokens`` rows before the launch; with sync checks on (eager) the
  one host read of the status word waits for the launch to publish it into pinned host memory
  (:class:`tritonep.runtime.host_status.HostStatus`: no device-to-host copy, no event) and the outputs are cut to the
  rows received (the same shapes and bits as the two-kernel path); refused calls raise the same typed errors after the
  launch, on every rank.
* push combine = ONE launch of :func:`tritonep.backends.triton.kernels.decode_combine.combine_decode_kernel` (no torch
  op advances the combine counter first): the weighted combine, and the dispatch backward (unweighted, with the
  weight gradients' return when asked).

Outputs: ONE pool shared by every buffer of the same shape (one per MoE layer: run one at a time) whose sets hold the
handle block AND the ``max_recv_tokens`` rows (one take per call), and one of the combine's ``[Tmax, H]`` outputs
(:mod:`tritonep.runtime.pool`); both are the outputs part's (``DispatchOutputs.decode_pool`` / ``ypool``).

Every rank makes the same launch with the same grid whatever its T (0 included) or input validity (docs/protocols.md,
host protocol rule).
"""

from __future__ import annotations

import torch

__all__ = ["DecodePath"]


class DecodePath:
    """Forward dispatch and push combine (weighted, or the dispatch backward) as one launch each (see the module
    docstring).

    Args:
        cfg: the buffer's config. kernels: its :class:`tritonep.backends.triton.calls.KernelSet`. status: its
            :class:`tritonep.backends.triton.status.CallStatus`. outputs: its
            :class:`tritonep.backends.triton.outputs.DispatchOutputs` (with the shared pools). device: the rank's
            device. no_w: a float32 ``[1]`` tensor for an unused ``gw_ptr`` (the weighted combine's).
    """

    def __init__(self, cfg, kernels, status, outputs, device: torch.device, no_w: torch.Tensor):
        self.cfg, self.k, self.status, self.outputs, self.device = cfg, kernels, status, outputs, device
        self._no_w = no_w

    def dispatch(self, x, topk_idx, topk_weights, sync, keep_quantized, bad_input, T, count=None):
        """Forward dispatch in one launch (``T`` tokens); returns what ``TritonEP.dispatch_fwd`` returns and raises
        what it raises (CapacityError / PeerInputError / InputError / PeerTimeoutError when ``sync``). The handle
        block and the rows come as ONE set of the shared pool (``(store, rows, row weights, ntpe, offs)``), or are
        allocated (graph capture, every set held). ``count``: None, or ``(count_ids [Tc, CK], count_experts, Tc, CK)``,
        the count routing (:func:`tritonep.backends.triton.kernels.decode_dispatch.dispatch_decode_kernel`): with
        ``sync`` its sums over the sources for this rank's ``count_experts / W`` local experts come back as the
        handle's ``count_sums`` (a list of ints, read with the status words: no second read); ``(count_ids,
        count_experts, Tc, CK, count_weights, ids dtype)``: also carried with the rows (the received rows' local ids
        and weights: the handle's ``carried``, cut as the rows are)."""
        max_recv, outs, status = self.cfg.max_recv_tokens, self.outputs, self.status
        # rows are known on the host only after the launch: the outputs hold the capacity, cut to R after the host
        # read (the kernel zeroes the row weights past the rows received: no memset before the launch; they are the
        # handle storage's field ``rw``)
        got = outs.decode_pool.take()
        if got is not None:
            store, out, rw, ntpe, offs = got
        else:
            store = outs.hl.new(self.device)
        if keep_quantized or got is None:  # quantized rows (never pooled), or the pool's rows were not to be had
            out, q, sc = outs.alloc_rows(max_recv, keep_quantized)
        else:
            q = sc = None
        ticket = status.ticket(sync)  # only a read takes one (HostStatus.next_ticket says why)
        if count is None:
            self.k.decode(q is not None)(x, topk_idx, topk_weights, store, T, int(bad_input), max_recv, out, q, sc,
                                         ticket)
        elif len(count) == 4:
            cid, ce, tc, ck = count
            self.k.decode(q is not None, ck, ce)(x, topk_idx, topk_weights, store, T, int(bad_input), max_recv, out,
                                                  q, sc, ticket, cid, tc)
        else:  # carried with the rows (kernels/carry.py): ids and weights beside every received row
            cid, ce, tc, ck, cw, id_dtype = count
            cidx, cwo = outs.carried(ck, id_dtype)  # pooled (reused once nobody holds them)
            self.k.decode(q is not None, ck, ce, True)(x, topk_idx, topk_weights, store, T, int(bad_input), max_recv,
                                                        out, q, sc, ticket, cid, tc, cw, cidx, cwo)
        # what needs no verdict is made while the launch runs (the host read waits for it anyway)
        if got is None:
            hl = outs.hl
            ntpe, offs, rw = hl.tensor(store, "ntpe"), hl.tensor(store, "offs"), hl.tensor(store, "rw")
        handle = outs.new_handle()
        st = status.read(ticket) if sync else None  # published once the verdict is known
        code, refused, R = status.verdict(st)
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
        status.finish(refused, st, sync, bad_input)
        if count is None:
            return outs.finish(handle, store, T, R, out, out_w, q, sc, ntpe, offs)
        carried = None
        if len(count) > 4:
            # fresh views, never the pooled tensors themselves (as the rows)
            carried = (cidx[:max_recv], cwo[:max_recv]) if R is None else (cidx[:R], cwo[:R])
        return outs.finish(handle, store, T, R, out, out_w, q, sc, ntpe, offs, self.k.count_sums(count, st is not None),
                           carried)

    def combine(self, eo, handle, wire, weighted=True, gw=None, bad=0, ticket=0):
        """Push combine in one launch: ``(y [T, H] (eo's dtype), gtw)``; ``weighted=False`` is the dispatch
        backward, whose ``gw [R]`` float32 (or None) comes back per route as ``gtw [T, K]`` float32 (else None).
        ``bad`` / ``ticket``: as ``TritonEP._combine`` (a refused rank; the host's read of an eager combine)."""
        T = handle.num_tokens
        if weighted:  # the forward combine: its output pooled (pool.py)
            got = self.outputs.ypool.take()
            y = got[0][:T] if got is not None else torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
            # the bound launch (KernelSet's variant lookup: one key, no closure built after the first call)
            self.k.combine_decode(wire)(eo, handle.store, y, T, self._no_w, y, bad, ticket)
            self.status.after_combine(ticket, bad, "combine")
            return y, None
        y = torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
        gtw = torch.empty(T, self.cfg.topk, dtype=torch.float32, device=self.device) if gw is not None else None
        self.k.combine_decode(wire, False, gw is not None)(eo, handle.store, y, T, self._no_w if gw is None else gw,
                                                           y if gtw is None else gtw, bad, ticket)
        self.status.after_combine(ticket, bad, "dispatch backward")
        return y, gtw
