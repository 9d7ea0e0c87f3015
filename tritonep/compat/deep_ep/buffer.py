"""``deep_ep.Buffer``: DeepEP's V1 (legacy) Buffer API on tritonep's EPBuffers.

See docs/deep_ep.md for the mapping of every call, what differs and what is not offered. Semantics follow DeepEP's
``deep_ep/buffer.py`` and ``csrc/deep_ep.cpp`` at its V1 API (commit 567632d, identical in ``deep_ep/buffers/
legacy.py`` of its v2 releases) and its tests (``tests/test_intranode.py``, ``tests/test_low_latency.py``); the code
is tritonep's own.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ...errors import BackendError, BufferStateError, ConfigError, InputError
from .config import Config, combine_config, dispatch_config, get_low_latency_rdma_size_hint
from .handles import LowLatencyHandle, NormalHandle
from .lanes import Lanes
from .low_latency import LowLatencyMode
from .normal import NormalMode
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "DEFAULTS"]

DEFAULTS: dict = {"backend": "auto", "max_tokens_per_rank": None, "num_sms": None, "device": None,
                  "timeout_s": None, "meta_rows_max_tokens": 256, "carry_topk": True}
"""tritonep's own Buffer arguments when a caller (a framework that only knows DeepEP's) does not pass them; set with
:func:`tritonep.compat.deep_ep.install` (``backend``: ``"auto"`` | ``"triton"`` | ``"nccl"``;
``max_tokens_per_rank``: fixed token capacity of the normal mode; ``num_sms``: SM cap of every kernel; ``device``;
``timeout_s``: the bound of every wait; ``meta_rows_max_tokens``: up to which rows-lane size a normal dispatch
carries its top-k as meta rows, one exchange; ``carry_topk``: whether such a dispatch carries it with the rows
instead, where the lane can)."""


def _begin(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """Order this call after ``previous_event`` on the current stream; DeepEP's argument rule for
    ``allocate_on_comm_stream``."""
    if allocate_on_comm_stream and not (previous_event is not None and async_finish):
        raise InputError("allocate_on_comm_stream=True needs previous_event and async_finish=True (as DeepEP)")
    ev = getattr(previous_event, "event", previous_event)
    if ev is not None:
        ev.current_stream_wait()


def _begun(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> Optional[InputError]:
    """:func:`_begin`, returning its InputError instead of raising it (a collective call still takes part)."""
    if previous_event is None and not allocate_on_comm_stream:  # nothing to order after, nothing to refuse
        return None
    try:
        _begin(previous_event, async_finish, allocate_on_comm_stream)
    except InputError as e:
        return e
    return None


_set_grad = torch._C._set_grad_enabled


def _no_grad() -> bool:
    """Turn autograd off (what ``with torch.no_grad():`` does, without its per-call object: about 2 us of host
    time less per call); returns the mode to restore with ``_set_grad``."""
    grad = torch.is_grad_enabled()
    _set_grad(False)
    return grad


def _end(async_finish: bool, tensors) -> EventOverlap:
    return EventOverlap(EventHandle(), tuple(t for t in tensors if isinstance(t, torch.Tensor))) if async_finish \
        else EventOverlap(None)


def _not_offered(what: str) -> BackendError:
    return BackendError(f"{what} is not offered by tritonep's DeepEP-compatible Buffer (docs/deep_ep.md)")


class Buffer:
    """DeepEP's expert-parallel communication buffer (V1 API), on tritonep.

    Args (DeepEP's):
        group: the EP ``torch.distributed`` group (gloo or NCCL; one process per rank).
        num_nvl_bytes, num_rdma_bytes: DeepEP's buffer sizes: accepted and kept as attributes, no effect (tritonep
            sizes its symmetric memory from the calls, :meth:`tritonep.EPBuffer.required_bytes`).
        low_latency_mode: enables the ``low_latency_*`` calls (as DeepEP; the normal calls work in both modes).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy: accepted,
            no meaning here (no RDMA queue pairs, NVSHMEM or fabric memory; :meth:`destroy` works either way).
        enable_shrink: refused when True (rank masks / fault tolerance are not offered).
        comm: refused when given without a group (an mpi4py communicator; pass a torch.distributed group).

    Args (tritonep's, keyword-only; defaults from :data:`DEFAULTS`, set by ``install(...)``):
        backend: the EPBuffers' backend: ``"auto"`` (symmetric memory on one host, else NCCL), ``"triton"``,
            ``"nccl"`` (groups that span hosts: DeepEP's internode mode).
        max_tokens_per_rank: fixed token capacity of the normal mode (None: the largest token count seen, grown
            collectively when a call needs more; :mod:`tritonep.compat.deep_ep.lanes`).
        num_sms: cap on the programs of every communication kernel (DeepEP's ``set_num_sms`` / ``Config.num_sms``
            size DeepEP's channels and have no effect here).
        device: the device of the EPBuffers (None: the current CUDA device, else the CPU, as EPBuffer).
        timeout_s: the bound of every in-kernel wait (TRITONEP_TIMEOUT_S by default).
        meta_rows_max_tokens: a normal dispatch with top-k carries its ids and weights as meta rows of its rows lane
            (one EPBuffer dispatch, a copy of ``x`` into the lane's input and of the combine's rows into its
            expert-output buffer) when that lane's tokens per rank (the token capacity plus the meta rows:
            :func:`tritonep.compat.deep_ep.packing.meta_rows_per_rank`) are at most this; else in a second EPBuffer
            (the meta lane: a second exchange, no copies). Default 256 (the triton backend's one-launch decode tiles
            go up to 256 tokens); 0: always the meta lane. Must be the same on every rank.
        carry_topk: where that rows lane carries a count routing with its rows (``EPBuffer.carries_topk``: the
            triton backend's one-launch decode tiles), the ids and weights ride with each token's row in the lane's
            own launch instead of as meta rows (no copy of ``x`` or of the combine's rows, no packing or unpacking
            launch: a dispatch is one launch, a combine one). Default True; False keeps the meta rows (to compare).
            Must be the same on every rank.

    Every call is collective over the group, as DeepEP's. EPBuffers are made on first use (collectively), so the
    constructor runs no collective.

    Raises:
        ConfigError: no group (or ``comm`` instead), a bad tritonep argument. BackendError: ``enable_shrink=True``.
    """

    num_sms: int = 20
    _serial = 0

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 backend: Optional[str] = None, max_tokens_per_rank: Optional[int] = None,
                 num_sms: Optional[int] = None, device=None, timeout_s: Optional[float] = None,
                 meta_rows_max_tokens: Optional[int] = None, carry_topk: Optional[bool] = None) -> None:
        if group is None:
            if comm is not None:
                raise _not_offered("Buffer(comm=...) (an mpi4py communicator); pass a torch.distributed group")
            raise ConfigError("Buffer needs a torch.distributed group")
        if enable_shrink:
            raise _not_offered("Buffer(enable_shrink=True) (rank masks for fault tolerance)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = False
        opt = dict(DEFAULTS)
        for k, v in (("backend", backend), ("max_tokens_per_rank", max_tokens_per_rank), ("num_sms", num_sms),
                     ("device", device), ("timeout_s", timeout_s), ("meta_rows_max_tokens", meta_rows_max_tokens),
                     ("carry_topk", carry_topk)):
            if v is not None:
                opt[k] = v
        mrm = opt["meta_rows_max_tokens"]
        if not isinstance(mrm, int) or isinstance(mrm, bool) or mrm < 0:
            raise ConfigError(f"meta_rows_max_tokens={mrm!r} must be an int >= 0")
        self.lanes = Lanes(group, opt["backend"], opt["device"], opt["num_sms"], opt["timeout_s"],
                           opt["max_tokens_per_rank"])
        Buffer._serial += 1
        self._id = Buffer._serial
        if not isinstance(opt["carry_topk"], bool):
            raise ConfigError(f"carry_topk={opt['carry_topk']!r} must be a bool")
        self._normal = NormalMode(self._id, self.lanes, self.rank, self.group_size, mrm, opt["carry_topk"])
        self._ll = LowLatencyMode(self._id, self.lanes, self.rank, self.group_size)

    # ------------------------------------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release every EPBuffer (collective, as DeepEP's). Later calls raise BufferStateError. A Buffer dropped
        without it keeps its memory until the process ends (releasing is collective: never done from a
        destructor, whatever ``explicitly_destroy`` says)."""
        self.lanes.close()

    def check(self) -> None:
        """tritonep's addition (DeepEP has none): read the status of every EPBuffer of this Buffer (one host read
        each) and raise the first error a call that read nothing recorded since: a ``num_worst_tokens`` dispatch
        refused for capacity, a peer's refused input or combine in a sync-free call (``num_worst_tokens``, cached
        dispatch, low-latency mode, host reads off), a peer that never arrived. Every rank holds the same record,
        so every rank raises (each error once). Call it after graph replays and low-latency steps, where no synced
        call follows; the next synced :meth:`dispatch` does the same for the calls before it.

        Raises:
            CapacityError / PeerInputError / InputError (this rank's own refused input) / PeerTimeoutError (the
            Buffer is then unusable): what was recorded. BufferStateError after :meth:`destroy`.
        """
        self._open()
        self.lanes.check(every=True)

    def _open(self):
        if self.lanes.closed:
            raise BufferStateError("the DeepEP-compatible Buffer was destroyed")

    def _own(self, handle, cls):
        if not isinstance(handle, cls) or handle.owner != self._id:
            raise InputError(f"handle must be a {cls.__name__} made by this Buffer's "
                             f"{'dispatch' if cls is NormalHandle else 'low_latency_dispatch'}")

    # ----------------------------------------------------------------------------------------------- statics
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: fp8 dispatch and every wire work on every device tritonep runs on (no compile flag)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set DeepEP's SM count (``Buffer.num_sms``, the ``num_sms`` of the recommended configs); no effect on
        tritonep's grids (``Buffer(num_sms=...)`` caps them).

        Raises:
            ConfigError: not an even positive int (as DeepEP).
        """
        if not isinstance(new_num_sms, int) or new_num_sms < 0 or new_num_sms % 2:
            raise ConfigError(f"num_sms={new_num_sms!r} must be an even int (as DeepEP)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (``EventOverlap(EventHandle())``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """DeepEP's low-latency buffer bytes (:func:`tritonep.compat.deep_ep.config.get_low_latency_rdma_size_hint`;
        no effect here)."""
        return get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch :class:`Config` (any group size; no effect on tritonep's kernels)."""
        return dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine :class:`Config` (any group size; no effect on tritonep's kernels)."""
        return combine_config(Buffer.num_sms, num_ranks)

    def get_comm_stream(self):
        """The stream tritonep's calls run on: the caller's current CUDA stream (there is no separate communication
        stream); None without CUDA."""
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """Refused: DeepEP's raw buffer has no counterpart (tritonep's symmetric regions are laid out per call)."""
        raise _not_offered("get_local_buffer_tensor (DeepEP's raw NVLink / RDMA buffer)")

    # ------------------------------------------------------------------------------------------- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """DeepEP's layout: ``(num_tokens_per_rank int32 [W], None, num_tokens_per_expert int32 [E],
        is_token_in_rank bool [T, W], event)`` from ``topk_idx [T, K]`` (-1 = none; an id outside ``[-1, E)`` selects
        nothing). Local (no exchange), device ops only.

        Raises:
            InputError: topk_idx not 2-D int32/int64; num_experts not a positive multiple of the group size.
        """
        self._open()
        if previous_event is not None or allocate_on_comm_stream:
            _begin(previous_event, async_finish, allocate_on_comm_stream)
        # no autograd mode to set: two int32 / bool allocations and a split of one of them (no op autograd records)
        per_rank, per_expert, in_rank = self._normal.layout(topk_idx, num_experts)
        return per_rank, None, per_expert, in_rank, (_end(True, (topk_idx, per_rank, per_expert, in_rank))
                                                     if async_finish else EventOverlap(None))

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to the ranks of its experts (DeepEP's normal dispatch).

        Args:
            x: ``[T, H]`` bfloat16, or ``(x_q [T, H] of a one-byte dtype (e.g. float8_e4m3fn), scales [T, S] of a
                four-byte dtype, any strides)`` with ``4*S <= H``: handed on bit for bit.
            handle: a handle of an earlier dispatch: cached dispatch of ``x`` along its layout (no top-k).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from :meth:`get_dispatch_layout` (required
                without a handle; ``is_token_in_rank`` decides which rank gets which token, ``num_tokens_per_expert``
                gives E). ``num_tokens_per_rdma_rank``: ignored (None intranode).
            topk_idx, topk_weights: ``[T, K]`` int32/int64 ids (-1 = none) and float32 weights, or both None.
            expert_alignment: the per-expert counts returned are rounded up to a multiple of it (rows are not).
            num_worst_tokens: when > 0: no host read (CUDA-graph capturable): ``num_worst_tokens`` rows returned,
                the received ones first, the rest with ids -1 and weight 0; the count list is empty. Needs top-k.
                When some rank would receive more rows, the call is refused on every rank: no row moves, the rows
                and weights returned are NaN (ids -1) and so is its combine's output, and every rank raises
                CapacityError at its next synced dispatch or :meth:`check`.
            config: ignored (DeepEP's chunk sizes). previous_event / async_finish / allocate_on_comm_stream: stream
                ordering, as DeepEP (every call runs on the current stream).

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:
            ``recv_x`` one row per (token, receiving rank), ordered by (source rank, source token) (a tuple for
            quantized x); ``recv_topk_idx`` local expert ids (-1 where the expert is elsewhere) in topk_idx's dtype;
            ``recv_topk_weights`` float32 (0 where the id is -1); the list: rows per local expert (aligned). A cached
            dispatch returns ``(recv_x, None, None, None, None, event)``.

        Raises:
            InputError (this rank's input, named) / PeerInputError (another rank's) on every rank, before any row
            moves (a ``num_worst_tokens`` or cached call reads nothing: the peers raise at their next synced
            dispatch or :meth:`check`); CapacityError with a fixed ``max_tokens_per_rank``; the first error an
            earlier call nobody read recorded (a synced call raises it on every rank before moving anything, as
            :meth:`check`); BufferStateError after :meth:`destroy`.
        """
        self._open()
        refused = None if previous_event is None and not allocate_on_comm_stream else \
            _begun(previous_event, async_finish, allocate_on_comm_stream)
        grad = _no_grad()
        try:
            recv_x, recv_idx, recv_w, counts, h = self._normal.dispatch(
                x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                expert_alignment, num_worst_tokens, refused)
        finally:
            _set_grad(grad)
        if not async_finish:
            return recv_x, recv_idx, recv_w, counts, h, EventOverlap(None)
        rx = recv_x if isinstance(recv_x, tuple) else (recv_x,)
        return recv_x, recv_idx, recv_w, counts, h, _end(True, rx + (recv_idx, recv_w))

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Bring each received row back and sum a token's rows over the ranks, unweighted (DeepEP's combine).

        Args:
            x: ``[R, H]`` bfloat16, one row per row the dispatch returned (``num_worst_tokens`` rows after such a
                dispatch).
            handle: the dispatch's handle.
            topk_weights: ``[R, K]`` float32 or None: each slot summed over the ranks that received the token, in
                float32 (DeepEP's reduction; megatron passes its probability gradients here).
            bias: a ``[T, H]`` bfloat16 tensor or a tuple of two, added to the result (in fp32, after the sum's
                bf16 rounding).
            config / previous_event / async_finish / allocate_on_comm_stream: as :meth:`dispatch`.

        Returns:
            ``(combined_x [T, H] bfloat16, combined_topk_weights [T, K] float32 or None, event)``; a token no rank
            received comes back as zeros.

        Raises:
            InputError: a bad handle, shape or dtype: no row moves, and this rank still takes part as refused
            (:meth:`tritonep.EPBuffer.cancel_combine`), so the peers raise PeerInputError naming it (a combine of a
            synced dispatch; after ``num_worst_tokens`` or with host reads off their output is NaN and their next
            synced dispatch or :meth:`check` raises it) and the Buffer stays usable. PeerInputError: a peer's
            combine input was refused. BufferStateError after :meth:`destroy`.
        """
        self._open()
        refused = None if previous_event is None and not allocate_on_comm_stream else \
            _begun(previous_event, async_finish, allocate_on_comm_stream)
        grad = _no_grad()
        try:
            y, w = self._normal.combine(x, handle, topk_weights, bias, refused)
        finally:
            _set_grad(grad)
        return y, w, (_end(True, (x, y, w)) if async_finish else EventOverlap(None))

    def internode_dispatch(self, *args, **kwargs):
        """DeepEP's internode dispatch: the same call as :meth:`dispatch` (a group that spans hosts runs on the nccl
        backend; ``Buffer(backend="nccl")`` or ``install(backend="nccl")``)."""
        return self.dispatch(*args, **kwargs)

    def internode_combine(self, *args, **kwargs):
        """DeepEP's internode combine: the same call as :meth:`combine`."""
        return self.combine(*args, **kwargs)

    # -------------------------------------------------------------------------------------- low-latency mode
    def _ll_open(self, what: str):
        self._open()
        if not self.low_latency_mode:
            raise ConfigError(f"{what} needs Buffer(low_latency_mode=True) (as DeepEP)")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: tritonep's signals carry a per-call epoch and never need resetting (DeepEP zeroes its
        low-latency signal buffers here). Kept for the callers that switch between modes."""
        self._ll_open("clean_low_latency_buffer")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, use_nvfp4: bool = False, x_global_scale=None):
        """Send each (token, expert) to the expert's rank; return the rows grouped per local expert, no host read.

        Args:
            x: ``[T, H]`` bfloat16, H a multiple of 128, T <= ``num_max_dispatch_tokens_per_rank`` (M, the same on
                every rank). topk_idx: ``[T, K]`` int32/int64 (negative = none; a token should not list an expert
                twice, as DeepEP's contract: docs/deep_ep.md "What differs" says what happens when it does).
            num_experts: E, a multiple of the group size.
            cumulative_local_expert_recv_stats: int32 ``[L]``, incremented by the rows each local expert received.
            use_fp8 / round_scale / use_ue8m0: fp8 e4m3 rows with one float32 scale per 128 elements (power-of-two
                scales with ``round_scale``; with ``use_ue8m0`` their exponent bytes packed four per int32, H % 512 ==
                0), quantized on the sender by :func:`tritonep.wire.fp8.quantize_fp8`.
            async_finish: return an event recorded after the call. return_recv_hook: return a hook that finishes
                the receive (the local unpacking into the returned tensors); the data is valid after ``hook()``.
            dispatch_wait_recv_cost_stats, use_nvfp4, x_global_scale: refused when given (not offered).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` ``[L, W*M, H]`` bfloat16, or ``(fp8 [L, W*M, H],
            scales [L, W*M, H/128] float32 or [L, W*M, H/512] int32, column-major in the last two dims)``; expert e's
            rows in ``[0, recv_count[e])``, ordered by (source rank, source token); ``recv_count`` int32 ``[L]``;
            ``hook`` None without ``return_recv_hook``.

        Raises:
            ConfigError: not a low-latency Buffer. InputError: a bad input (named; this rank still takes part as
            refused, so the peers' rows are empty and their next synced call or :meth:`check` raises
            PeerInputError). BackendError: an option that is not offered (refused the same way).
        """
        self._ll_open("low_latency_dispatch")
        refused = None
        if dispatch_wait_recv_cost_stats is not None:
            refused = _not_offered("low_latency_dispatch(dispatch_wait_recv_cost_stats=...) (per-rank wait timing)")
        elif use_nvfp4 or x_global_scale is not None:
            refused = _not_offered("low_latency_dispatch(use_nvfp4=True / x_global_scale=...) (DeepEP's hybrid-ep "
                                   "NVFP4)")
        elif async_finish and return_recv_hook:
            refused = InputError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        with torch.no_grad():
            recv, count, h, receive = self._ll.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                        cumulative_local_expert_recv_stats, use_fp8, round_scale,
                                                        use_ue8m0, refused)
        hook = None
        if return_recv_hook:
            def hook():  # inference mode: the outputs may have been made inside it and the hook run outside
                with torch.inference_mode():  # (an in-place write to a normal tensor is allowed in it too)
                    receive()
        else:
            with torch.no_grad():
                receive()
        rx = recv if isinstance(recv, tuple) else (recv,)
        return recv, count, h, _end(async_finish, (x, topk_idx) + rx + (count,)), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **kwargs):
        """Bring every (token, expert) row back and reduce with the weights (DeepEP's low-latency combine).

        Args:
            x: ``[L, W*M, H]`` bfloat16, contiguous: expert e's outputs in its first ``recv_count[e]`` rows (the rest
                is never read). topk_idx / topk_weights: ``[T, K]`` as the dispatch's ids (slots with -1 are skipped)
                and float32 weights. handle: the dispatch's.
            zero_copy: read the rows from :meth:`get_next_low_latency_combine_buffer` instead of ``x``.
            out: ``[T, H]`` bfloat16 contiguous output (else a new tensor).
            async_finish / return_recv_hook: as :meth:`low_latency_dispatch` (the hook runs the weighted reduction).
            use_logfmt, combine_wait_recv_cost_stats and SGLang's overlap arguments: refused when given.

        Returns:
            ``(combined_x [T, H] = sum_k w[t, k] * row(t, k) (fp32, one bf16 rounding), event, hook)``.

        Raises:
            ConfigError / InputError / BackendError: as :meth:`low_latency_dispatch` (a refused input or handle
            takes part as refused: :meth:`tritonep.EPBuffer.cancel_dispatch_backward`; the peers' output is NaN and
            their next synced call or :meth:`check` raises PeerInputError naming this rank).
        """
        self._ll_open("low_latency_combine")
        refused = None
        if use_logfmt:
            refused = _not_offered("low_latency_combine(use_logfmt=True) (DeepEP's LogFMT-10 combine wire)")
        elif combine_wait_recv_cost_stats is not None:
            refused = _not_offered("low_latency_combine(combine_wait_recv_cost_stats=...) (per-rank wait timing)")
        elif kwargs:
            refused = _not_offered(f"low_latency_combine({', '.join(sorted(kwargs))}) (compute/communication "
                                   f"overlap signals of DeepEP forks)")
        elif async_finish and return_recv_hook:
            refused = InputError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        with torch.no_grad():
            y, reduce = self._ll.combine(x, topk_idx, topk_weights, handle, zero_copy, out, refused)
        hook = None
        if return_recv_hook:
            def hook():  # inference mode: the outputs may have been made inside it and the hook run outside
                with torch.inference_mode():  # (an in-place write to a normal tensor is allowed in it too)
                    reduce()
        else:
            with torch.no_grad():
                reduce()
        return y, _end(async_finish, (x, topk_idx, topk_weights, y)), hook

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The ``[L, W*M, H]`` bfloat16 tensor the next ``low_latency_combine(..., zero_copy=True)`` with this handle
        reads: fill it instead of passing ``x`` (one per handle, made on first request)."""
        self._ll_open("get_next_low_latency_combine_buffer")
        self._own(handle, LowLatencyHandle)
        return self._ll.next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Refused: rank masks (DeepEP's shrink mode) are not offered."""
        raise _not_offered("low_latency_update_mask_buffer (rank masks / shrink mode)")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """Refused: rank masks (DeepEP's shrink mode) are not offered."""
        raise _not_offered("low_latency_query_mask_buffer (rank masks / shrink mode)")

    def low_latency_clean_mask_buffer(self):
        """Refused: rank masks (DeepEP's shrink mode) are not offered."""
        raise _not_offered("low_latency_clean_mask_buffer (rank masks / shrink mode)")
