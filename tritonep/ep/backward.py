"""EPBuffer's backward entry points outside autograd: :meth:`dispatch_backward` / :meth:`combine_backward` and their
cancelled forms :meth:`cancel_dispatch_backward` / :meth:`cancel_combine_backward` (docs/architecture.md).

A mixin of :class:`tritonep.ep.buffer.EPBuffer` (its methods are EPBuffer's: no extra call per entry); it reads the
buffer's ``_backend``, ``config`` and handle checks, which :mod:`tritonep.ep.buffer` sets up.

Idea sources: DeepEP's ``Buffer`` (dispatch / combine backward as the other direction's forward), our own host
protocol rule for refused inputs (docs/protocols.md).
"""

from __future__ import annotations

import torch

from ..errors import BackendError, ConfigError, InputError
from .autograd import DispatchBwdFn, combine_bwd_graph, has_tangent
from .handle import DispatchHandle
from .validate import check_backward_inputs, check_combine_inputs

__all__ = ["BackwardCalls"]


class BackwardCalls:
    """The backward half of :class:`tritonep.ep.buffer.EPBuffer`'s calls, outside autograd (a mixin; see the
    methods). Every method is collective: each rank calls it for the matching dispatch / combine, a refused input
    included (it takes part as refused, so no peer waits for it)."""

    def dispatch_backward(self, grad_recv_x: torch.Tensor, grad_recv_w: torch.Tensor | None,
                          handle: DispatchHandle) -> tuple:
        """The backward half of :meth:`dispatch`, outside autograd (for callers that chain backward pieces).

        Returns ``(grad_x, grad_topk_weights)``: ``grad_x[t] = sum_k grad_recv_x[row(t, k)]`` (``[T, H]``) and
        ``grad_topk_weights[t, k] = grad_recv_w[row(t, k)]`` (``[T, K]`` float32; ``None`` when ``grad_recv_w``
        is ``None``). Collective: every rank calls it for the matching dispatch.

        A refused input (this rank raises InputError / ConfigError) still takes part in the call
        (:meth:`cancel_dispatch_backward`), so no peer waits for this rank: the peers' outputs are NaN (see there)
        and their next :meth:`check` or synced dispatch raises :class:`PeerInputError` naming this rank (this call
        reads nothing on the host, as every backward).

        Raises:
            ConfigError: ``handle`` does not come from this buffer. InputError: ``grad_recv_x`` not ``[rows, H]``
                of the buffer's dtype and device with at least the dispatch's rows, or ``grad_recv_w`` not None /
                float32 ``[rows]`` (no row moves). PeerTimeoutError as :meth:`dispatch`.
        """
        self._check_open()
        try:
            self._check_handle(handle)
            grad_recv_x, grad_recv_w = check_backward_inputs(
                grad_recv_x, handle, hidden=self.hidden, dtype=self.dtype, device=self.device,
                min_rows=self._rows_of(handle), grad_w=grad_recv_w, name="grad_recv_x")
        except (InputError, ConfigError):
            # refused on this rank: it still takes part (host protocol rule), so no peer waits for it
            try:
                self.cancel_dispatch_backward(handle, with_weights=grad_recv_w is not None)
            except BackendError:
                pass  # nccl, no dispatch yet on this buffer: no peer can be in its backward either
            raise
        if has_tangent(grad_recv_x, grad_recv_w):  # forward-mode AD: linear, the tangent is the same call's
            return DispatchBwdFn.apply(grad_recv_x, grad_recv_w, self._backend, handle)
        return self._backend.dispatch_bwd(grad_recv_x, grad_recv_w, handle)

    def cancel_dispatch_backward(self, handle: DispatchHandle | None = None, with_weights: bool = False) -> None:
        """Take part in the :meth:`dispatch_backward` that matches ``handle`` WITHOUT a gradient (the backward half's
        :meth:`cancel_combine`): for a rank whose own code failed before it (call it in the ``except`` block, then
        re-raise), so its peers do not wait for it and none of them returns a value computed without its rows.

        Collective: it stands for this rank's :meth:`dispatch_backward` call (same launches and collectives, no row
        moves). Every other rank's output of that call is NaN (``grad_x`` and ``grad_topk_weights``: all of it on the
        triton backend; on the nccl backend every element computed from this rank's rows, the others being exact,
        which saves a fill per backward) and its next :meth:`check` or synced dispatch raises
        :class:`PeerInputError` naming this rank; so does this rank's. The buffer stays usable.
        :meth:`dispatch_backward` does the same by itself when it refuses its input. Cost: none on the triton
        backend; the nccl backend's dispatch backward gathers one int32 flag per rank (one small collective) in
        every call for it, as its forward combine does.

        Args:
            handle: the dispatch's handle on this rank, or None (the latest dispatch's; the nccl backend needs the
                dispatch's split sizes).
            with_weights: whether the peers pass ``grad_recv_w`` (it picks the same kernels as theirs).

        Raises:
            BackendError: nccl backend, no dispatch to take the split sizes from (no peer can be in a backward).
        """
        self._check_open()
        own = isinstance(handle, DispatchHandle) and handle.buffer_id == self._id
        self._backend.dispatch_bwd_refused(handle if own else None, bool(with_weights))

    def combine_backward(self, grad_y: torch.Tensor, expert_out: torch.Tensor, handle: DispatchHandle) -> tuple:
        """The backward half of :meth:`combine`, outside autograd.

        Returns ``(grad_expert_out, grad_recv_weights)``: ``grad_expert_out[row] = w(row) * grad_y[t(row)]``
        (``[R, H]``) and ``grad_recv_weights[row] = <grad_y[t(row)], expert_out[row]>`` (``[R]`` float32).
        Collective: every rank calls it for the matching combine.

        A refused input (this rank raises InputError / ConfigError) still takes part in the call
        (:meth:`cancel_combine_backward`), so no peer waits for this rank: the peers' outputs are NaN (see there)
        and their next :meth:`check` or synced dispatch raises :class:`PeerInputError` naming this rank (this call
        reads nothing on the host, as every backward).

        Raises:
            ConfigError: ``handle`` does not come from this buffer. InputError: ``grad_y`` not ``[T, H]`` or
                ``expert_out`` not as in :meth:`combine` (dtype, device, shape; no row moves). PeerTimeoutError as
                :meth:`dispatch`.
        """
        self._check_open()
        try:
            self._check_handle(handle)
            grad_y, _ = check_backward_inputs(grad_y, handle, hidden=self.hidden, dtype=self.dtype,
                                              device=self.device, min_rows=0)
            expert_out = check_combine_inputs(expert_out, handle, hidden=self.hidden, dtype=self.dtype,
                                              device=self.device, min_rows=self._rows_of(handle))
        except (InputError, ConfigError):
            # refused on this rank: it still takes part (host protocol rule), so no peer waits for it
            try:
                self.cancel_combine_backward(handle)
            except BackendError:
                pass  # nccl, no dispatch yet on this buffer: no peer can be in its backward either
            raise
        if has_tangent(grad_y, expert_out, handle.recv_weights):  # forward-mode AD: the same sums as torch ops
            return combine_bwd_graph(self._backend, handle, grad_y, expert_out, handle.recv_weights)
        return self._backend.combine_bwd(grad_y, expert_out, handle)

    def cancel_combine_backward(self, handle: DispatchHandle | None = None) -> None:
        """Take part in the :meth:`combine_backward` that matches ``handle`` WITHOUT a gradient (the combine
        backward's :meth:`cancel_dispatch_backward`): for a rank whose own code failed before it (call it in the
        ``except`` block, then re-raise), so its peers do not wait for it and none of them returns a value computed
        without its rows.

        Collective: it stands for this rank's :meth:`combine_backward` call (same launches and collectives, no row
        moves). Every other rank's output of that call is NaN (``grad_expert_out`` and ``grad_recv_weights``: all of
        it on the triton backend; on the nccl backend every row received from this rank, the others being exact)
        and its next :meth:`check` or synced dispatch raises :class:`PeerInputError` naming this rank; so does this
        rank's. The buffer stays usable. :meth:`combine_backward` does the same by itself when it refuses its input.
        Cost: none on the triton backend (the mark is the token count its send writes anyway, -1); the nccl
        backend's combine backward gathers one int32 flag per rank (one small collective) in every call for it, as
        its dispatch backward does.

        Args:
            handle: the dispatch's handle on this rank, or None (the latest dispatch's; the nccl backend needs the
                dispatch's split sizes). A handle of another buffer counts as None.

        Raises:
            BackendError: nccl backend, no dispatch to take the split sizes from (no peer can be in a backward).
        """
        self._check_open()
        own = isinstance(handle, DispatchHandle) and handle.buffer_id == self._id
        self._backend.combine_bwd_refused(handle if own else None)
