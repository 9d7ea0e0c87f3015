"""Host-side pieces of a forward dispatch shared by every path of the triton backend (two kernels, fused, decode).

:class:`DispatchOutputs` is a mixin of :class:`tritonep.ep.triton.backend.TritonEP`: it reads the backend's static
configuration (``W``, ``E``, ``H``, ``K``, ``Tm``, ``max_recv``, ``dwire``, ``dtype``, ``device``, ``status``,
``timeout_s``) and allocates the handle and the outputs, turns the one host read of the status word into the
verdict, and raises a refused call's typed error after its launches (docs/protocols.md, host protocol rule:
every rank launches anyway).
"""

from __future__ import annotations

import torch

from dataclasses import replace

from ...errors import PeerTimeoutError
from ...kernels import protocol as P
from ..handle import TritonHandle
from ..status import STATUS_BAD_INPUT, STATUS_CAPACITY, bad_ranks, raise_for_status
from ..validate import check_expert_ids

__all__ = ["DispatchOutputs", "ST_HOST"]

_ST_ERR = P.v(P.STATUS_WORDS)  # the status word's error part
_CODE = P.v(P.ST_CODE)
_ROWS = P.v(P.ST_ROWS_RECEIVED)
ST_HOST = _ROWS + 1  # what the one host read of a dispatch copies (status word + rows received)


class DispatchOutputs:
    """Handle / output allocation and the verdict of a forward dispatch (see the module docstring)."""

    def _new_handle(self, topk_idx, topk_weights, T, counts):
        """A forward dispatch's handle (device tensors to be filled by the kernels; ``counts``: the [W, E] snapshot).
        ``num_recv_rows`` is stamped by :meth:`_dispatch_result` (a new frozen handle)."""
        return TritonHandle(topk_idx=topk_idx, topk_weights=topk_weights, counts=counts,
                            rows=torch.empty(T, self.K, dtype=torch.int32, device=self.device),
                            meta=torch.empty(self.W, self.Tm, self.K, dtype=torch.int32, device=self.device),
                            wts=torch.empty(self.W, self.Tm, self.K, dtype=torch.float32, device=self.device),
                            ntok=torch.empty(self.W, dtype=torch.int32, device=self.device),
                            num_tokens=T, num_recv_rows=None)

    def _verdict(self, st, handle):
        """``(code, refused, R)`` from the host copy of the status word (None: not read); raises PeerTimeoutError
        (and marks the buffer unusable) for a wait that gave up."""
        code = int(st[_CODE]) if st is not None else 0
        refused = code in (STATUS_CAPACITY, STATUS_BAD_INPUT)
        if code != 0 and not refused:
            try:
                raise_for_status(st[:_ST_ERR], self.rank, self.max_recv, "dispatch", self.timeout_s, self.device.type)
            except PeerTimeoutError as e:
                self.broken = str(e)  # later calls repeat the wait, the peer and the measured wait
                raise
        R = None if st is None else (0 if refused else int(st[_ROWS]))
        return code, refused, R

    def _alloc_out(self, nrows, exact, keep_quantized):
        """``(out, out_w, q, sc)`` for ``nrows`` received rows; ``exact=False`` (rows unknown on the host): the
        weights past the received rows stay zero (rows are not cleared: with sync checks off they are unspecified)."""
        q = sc = None
        if keep_quantized and self.dwire.quantized:
            # padding rows hold the encoding of a zero row (fp8 scale 2^-126, e8m0 0), as the twins give
            q, sc = self.dfmt.empty_quantized(nrows, self.H, self.device)
            out = torch.empty(0, self.H, dtype=self.dtype, device=self.device)
        else:
            out = torch.empty(nrows, self.H, dtype=self.dtype, device=self.device)
        out_w = torch.empty(nrows, dtype=torch.float32, device=self.device) if exact else \
            torch.zeros(nrows, dtype=torch.float32, device=self.device)
        return out, out_w, q, sc

    def _dispatch_result(self, code, refused, st, sync, bad_input, topk_idx, out, out_w, q, sc, ntpe, offs, handle,
                         R):
        """Raise a refused call's error (after its launches), else the forward dispatch's return tuple."""
        if refused:
            self.status.zero_()  # reported once, here; the buffer stays usable (stream-ordered after the kernels)
            if code == STATUS_BAD_INPUT and self.rank in bad_ranks(st) and not bad_input:
                check_expert_ids(topk_idx, self.E)  # raises InputError naming the value
            raise_for_status(st[:_ST_ERR], self.rank, self.max_recv, "dispatch", self.timeout_s, self.device.type)
        if sync:
            self._eager_check("dispatch")  # a peer that stopped after the counts exchange raises in this call
        handle = replace(handle, num_recv_rows=R, x_scales=sc)
        return (out if q is None else q), out_w, ntpe, offs, handle
