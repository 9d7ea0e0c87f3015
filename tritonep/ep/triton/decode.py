"""The one-launch decode paths of the triton backend (geometry ``decode > 0``, small ``max_tokens_per_rank``).

:class:`DecodePath` is a mixin of :class:`tritonep.ep.triton.backend.TritonEP` (it uses the backend's regions,
pointer tables, geometry and :class:`tritonep.ep.triton.outputs.DispatchOutputs`):

* forward dispatch = ONE launch of :func:`tritonep.kernels.decode_dispatch.dispatch_decode_kernel` (counts exchange,
  layout, send, wait, expand; it advances the call counters itself). The outputs are allocated for
  ``max_recv_tokens`` rows before the launch; with sync checks on (eager) the one host read of the status word
  comes after the launch and the outputs are cut to the rows received (the same shapes and bits as the two-kernel
  path); refused calls raise the same typed errors after the launch, on every rank.
* weighted push combine = ONE launch of :func:`tritonep.kernels.decode_combine.combine_decode_kernel` (no torch op
  advances the combine counter first).

Every rank makes the same launch with the same grid whatever its T (0 included) or input validity (docs/protocols.md, host protocol rule).
"""

from __future__ import annotations

import torch
import triton

from ...kernels import protocol as P
from ...kernels.decode_combine import combine_decode_kernel
from ...kernels.decode_dispatch import dispatch_decode_kernel
from .outputs import ST_HOST

__all__ = ["DecodePath"]


class DecodePath:
    """Forward dispatch and weighted push combine as one launch each (see the module docstring)."""

    def _dispatch_decode(self, x, topk_idx, topk_weights, sync, keep_quantized, bad_input):
        """Forward dispatch in one launch; returns what ``TritonEP.dispatch_fwd`` returns and raises what it raises
        (CapacityError / PeerInputError / InputError / PeerTimeoutError when ``sync``)."""
        g, b, dev = self.geo, self.buf, self.device
        T = x.shape[0]
        ntpe = torch.empty(self.L, dtype=torch.int32, device=dev)
        offs = torch.empty(self.L, dtype=torch.int32, device=dev)
        counts = torch.empty(self.W, self.E, dtype=torch.int32, device=dev)
        handle = self._new_handle(topk_idx, topk_weights, T, counts)
        # rows are known on the host only after the launch: allocate the capacity, cut to R after the host read
        # (the kernel zeroes out_w past the rows received: no memset before the launch)
        out, out_w, q, sc = self._alloc_out(self.max_recv, True, keep_quantized)
        self._launch(dispatch_decode_kernel, (g.decode,),
                     x, topk_idx, topk_weights, handle.rows, T, int(bad_input), self.max_recv, out_w.shape[0],
                     self.hist, self.pre,
                     self.tab["counts"], b.local("counts"), self.tab["stage"], self.tab["meta"], self.tab["wts"],
                     self.tab["ntok"], self.tab["cflag"], b.local("cflag"), b.local("stage"), b.local("meta"),
                     b.local("wts"), b.local("ntok"), out, out_w, handle.meta, handle.wts, handle.ntok, ntpe, offs,
                     self.rows_needed, counts, self.flags, self.tab["flags"], self._flag_off(P.FLAG_COUNTS),
                     self._flag_off(P.FLAG_DATA), self._flag_off(P.FLAG_ACK), self.calls, self.status, self.timeout,
                     self.Tm, self.ncmax, E=self.E, L=self.L, LB=triton.next_power_of_2(self.L),
                     TB=triton.next_power_of_2(self.Tm), BA=triton.next_power_of_2(max(self.A, 1)), A=self.A,
                     WIRE=self.dwire, KEEP_Q=q is not None, q_ptr=q, s_ptr=sc, **self._ck)
        st = None
        if sync:
            self.host_reads += 1  # the one host read of the call: (status, rows this rank received)
            if dev.type == "cuda":
                self._st_host.copy_(self.status[:ST_HOST], non_blocking=True)
                self._st_event.record()
                self._st_event.synchronize()
                st = self._st_host.clone()
            else:
                st = self.status[:ST_HOST].clone()
        code, refused, R = self._verdict(st, handle)
        if R is not None:
            out, out_w = (out if q is not None else out[:R]), out_w[:R]
            if q is not None:
                q, sc = q[:R], sc[:R]
        return self._dispatch_result(code, refused, st, sync, bad_input, topk_idx, out, out_w, q, sc, ntpe, offs,
                                     handle, R)

    def _combine_decode(self, eo, handle, wire):
        """Weighted push combine in one launch: ``y [T, H]`` (eo's dtype)."""
        T = handle.num_tokens
        y = torch.empty(T, self.H, dtype=eo.dtype, device=self.device)
        self._launch(combine_decode_kernel, (self.geo.decode,),
                     eo, handle.meta, handle.wts, handle.ntok, self.tab["cstage"], self.tab["ccflag"],
                     self.buf.local("ccflag"), handle.topk_idx, y, T, self.flags, self.tab["flags"],
                     self._flag_off(P.FLAG_CDATA), self._flag_off(P.FLAG_CACK), self.calls, self.status, self.timeout,
                     self.Tm, self.ncmax, L=self.L, WIRE=wire, **self._ck)
        self._eager_check("combine")
        return y
