"""EPBuffer: the public front door of dispatch / combine (docs/architecture.md).

Checks every input before any peer is touched (:mod:`tritonep.ep.validate`), checks once at construction that every
rank has the same static configuration, picks a backend (``triton``: symmetric memory + Triton kernels on one host;
``nccl``: torch.distributed all_to_all for groups that span hosts) and wraps both in autograd. The backward entry
points (:mod:`tritonep.ep.backward`) and the refusal / cancel / deferred-error ones (:mod:`tritonep.ep.refusal`) are
mixins of :class:`EPBuffer`, in modules of their own.

Idea sources: DeepEP's ``Buffer`` (dispatch/combine with a handle, expert-grouped receive for grouped GEMMs),
pplx-kernels (static capacity, graph capture), our own protocol for the kernels (docs/protocols.md).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from .. import envs
from ..errors import BufferStateError, CapacityError, ConfigError, InputError, PeerInputError, TritonEPError
from ..wire.formats import get_wire
from .autograd import CombineFn, DispatchFn, has_tangent
from .backend_choice import choose_from_reports, p2p_report
from .backward import BackwardCalls
from ..backends import build_backend, required_bytes as backend_required_bytes
from .config import EPConfig, agree, build_config
from .handle import Dispatched, DispatchHandle
from .refusal import RefusalCalls
from .validate import check_combine_inputs, check_count_ids, check_dispatch_inputs

__all__ = ["EPBuffer"]

_NO_TANGENT = ("a forward-mode dual tensor (torch.autograd.forward_ad) reaches {what}: its tangent would be lost, "
               "so the input is refused; EPBuffer.dispatch / combine / dispatch_backward / combine_backward carry "
               "tangents exactly")


class EPBuffer(BackwardCalls, RefusalCalls):
    """Expert-parallel dispatch / combine buffer for one process group.

    Args:
        group: the EP ``torch.distributed`` group (one rank per device; gloo on CPU, NCCL on GPU).
        num_experts: E, a multiple of the group size; expert e lives on rank ``e // (E / world_size)``.
        hidden: H, the row width.
        max_tokens_per_rank: static capacity of T on every rank (graph capture sizes from it).
        topk: K, experts per token.
        dispatch_wire / combine_wire: a registered wire, :data:`tritonep.wire.WIRES` (``"bf16"``, ``"fp8"``,
            ``"mxfp4"``, ``"fp8_e5m2"``; sizes and bits in :mod:`tritonep.wire.formats`).
        expert_alignment: A; every expert segment starts at a multiple of A and its padding rows are zero.
        max_recv_tokens: rows this rank can receive (default: the worst case ``W*Tmax*K + L*(A-1)``).
        backend: ``"auto"`` (triton when every rank can map every peer's memory, else nccl) | ``"triton"`` |
            ``"nccl"``.
        dtype: element type of x and of the expert outputs: torch.bfloat16 only (ConfigError otherwise).
        device: the rank's device (default: the current CUDA device, else CPU). A CPU buffer runs the kernels in
            Triton's interpreter and lives in a CPU world (:func:`tritonep.testing.run_cpu_world`).
        num_sms: cap on the programs of every communication kernel (default: ``TRITONEP_NUM_SMS``, else the
            kernel-tile table's grids).
        timeout_s: bound of every in-kernel wait of this buffer, seconds (default ``TRITONEP_TIMEOUT_S``, 300 s):
            how long one rank may reach a call after another (checkpoint writing, evaluation on one rank) before
            the waiting rank gives up with :class:`PeerTimeoutError` (the buffer is then unusable).

    Options (keyword only; each left None takes its ``TRITONEP_*`` variable, read once here: :mod:`tritonep.envs`):
        tiles: the kernel tiles: an override of the table's choice in TRITONEP_GEOMETRY's form (``"bt=2,dec=3"``,
            ``"combine=pull"``; fields in :func:`tritonep.envs.geometry_override`), or kernel tiles given whole
            (:attr:`tiles` of another buffer).
        sync_checks: host reads of eager calls, ``"deferred"`` (one read per dispatch), ``"strict"`` (also one at
            the end of every call) or ``"none"`` (no read: as under graph capture); TRITONEP_SYNC_CHECKS.
        max_programs: cap on the programs of every kernel that waits on a peer (ranks that share a GPU under MPS);
            TRITONEP_MAX_PROGRAMS.
        launch: how launches reach the GPU, ``"packed"`` / ``"direct"`` / ``"triton"``
            (:data:`tritonep.envs.LAUNCH_MODES`); TRITONEP_FAST_LAUNCH / TRITONEP_PACKED_LAUNCH.
        output_pool: sets of per-call outputs reused per stream (0: every call allocates); TRITONEP_OUTPUT_POOL.
        sync_free_mode: how a sync-free dispatch exchanges its counts where the backend has two ways (``"onehop"``
            / ``"gather"``; the nccl backend); TRITONEP_NCCL_SYNC_FREE.
        count_columns: room for the per-local-expert sums of :meth:`dispatch`'s ``count_ids`` (at most this many
            local experts per rank; 0: none, the default). The attribute ``sums_counts`` says whether this buffer
            computes them (the triton backend; on the nccl backend ``count_sums`` stays None). The triton backend
            adds one int32 column per rank to the region (every rank's count stamp of a call: docs/protocols.md).
        count_topk: room for a count routing of the tokens themselves carried with the rows (:meth:`dispatch`'s
            ``count_weights`` / ``count_out``: at most this many ids a token; needs ``count_columns``; 0: none, the
            default). The attribute ``carries_topk`` says whether this buffer carries them (the triton backend's
            one-launch decode tiles); the region holds ``2 * count_topk`` int32 words per (source rank, token).

    Raises:
        ConfigError: an invalid value, or a static configuration that differs across ranks (raised on every rank,
            naming the field and each rank's value); a CPU device while tritonep's kernels were imported without
            ``TRITON_INTERPRET=1`` (or CUDA with it), before any collective.
        HeapError: a CPU buffer outside a CPU world (no CPU symmetric heap installed in this process).
        WireError: an unknown wire or a hidden size the wire cannot take.
    """

    def __init__(self, group, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dispatch_wire: str = "bf16", combine_wire: str = "bf16", expert_alignment: int = 1,
                 max_recv_tokens: int | None = None, backend: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, num_sms: int | None = None,
                 timeout_s: float | None = None, *, tiles=None, sync_checks=None, max_programs: int | None = None,
                 launch: str | None = None, output_pool: int | None = None, sync_free_mode: str | None = None,
                 count_columns: int = 0, count_topk: int = 0):
        self.group = group
        self.rank = dist.get_rank(group)
        ws = dist.get_world_size(group)
        cfg = err = report = None
        try:  # every check of this rank's arguments, before the first collective and before any allocation
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                    torch.device("cpu")
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            cfg = build_config(world_size=ws, num_experts=num_experts, hidden=hidden,
                               max_tokens_per_rank=max_tokens_per_rank, topk=topk, dispatch_wire=dispatch_wire,
                               combine_wire=combine_wire, expert_alignment=expert_alignment,
                               max_recv_tokens=max_recv_tokens, backend=backend, dtype=dtype,
                               device_type=device.type, num_sms=num_sms, timeout_s=timeout_s, tiles=tiles,
                               sync_checks=sync_checks, max_programs=max_programs, launch=launch,
                               output_pool=output_pool, sync_free_mode=sync_free_mode, count_columns=count_columns,
                               count_topk=count_topk)
            report = p2p_report(device)
        except TritonEPError as e:
            err = e
        # the one collective of the constructor: every rank's verdict, config and peer-access report (a refused
        # configuration on any rank raises on every rank; differing configurations raise, naming the field)
        reports = agree(group, cfg, err, extra=report)
        self.config: EPConfig = cfg
        self.device = device
        self._cuda = device.type == "cuda"
        self.backend, self.backend_reason = choose_from_reports(backend, reports)
        with torch.inference_mode(False):  # the backend's persistent tensors: normal ones, also for a buffer built
            # inside inference mode (calls in grad mode update them in place)
            self._backend = build_backend(self.backend, cfg, group=group, rank=self.rank, device=device)
        self._closed = False
        EPBuffer._serial += 1
        self._id = EPBuffer._serial
        self._backend.buffer_id = self._id
        self._quantized_dispatch = get_wire(cfg.dispatch_wire).quantized
        # whether dispatch(count_ids=...) sums the count routing on this buffer (handle.count_sums of an eager call):
        # the triton backend, with count_columns
        self.sums_counts = bool(cfg.count_columns) and getattr(self._backend, "sums_counts", False)
        # whether dispatch(count_weights=..., count_out=...) carries the tokens' count routing with the rows: the
        # triton backend's one-launch decode dispatch, with count_topk
        self.carries_topk = bool(cfg.count_topk) and getattr(self._backend, "decode", None) is not None
        self._sync = cfg.sync_checks
        # the front door's static arguments, made once: check_dispatch_inputs' and check_combine_inputs'
        # a bool rank mask as topk_idx (topk == W): read by the decode tiles' kernel, else made expert ids here
        mask = None
        if cfg.topk == ws:
            mask = True if getattr(self._backend, "decode", None) is not None else \
                torch.arange(ws, dtype=torch.int32, device=device) * cfg.num_local_experts
        self._din = (cfg.hidden, cfg.topk, cfg.max_tokens_per_rank, cfg.dtype, device, mask)
        self._cin = (cfg.hidden, cfg.dtype, device)
        self._last_synced = True
        self._deferred = None  # an error raised at the next check() (defer)
        self._no_input = (torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=device),
                          torch.empty(0, cfg.topk, dtype=torch.int64, device=device),
                          torch.empty(0, cfg.topk, dtype=torch.float32, device=device))

    # ------------------------------------------------------------------------------------------- config
    # world_size, num_experts, num_local_experts, hidden, max_tokens_per_rank, topk, dispatch_wire, combine_wire,
    # expert_alignment, max_recv_tokens, dtype, timeout_s: the config's own (read-only properties made below the
    # class from EPConfig.FRONT; each documented on tritonep.ep.config.EPConfig)

    _serial = 0

    # ------------------------------------------------------------------------------------------- static
    @staticmethod
    def required_bytes(world_size: int, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                       dispatch_wire: str = "bf16", combine_wire: str = "bf16", expert_alignment: int = 1,
                       max_recv_tokens: int | None = None, dtype: torch.dtype = torch.bfloat16,
                       device_type: str = "cuda", backend: str = "auto", num_sms: int | None = None, *,
                       tiles=None, max_programs: int | None = None, count_columns: int = 0,
                       count_topk: int = 0) -> int:
        """Symmetric bytes one rank allocates for this configuration (no group needed).

        Equals what the backend allocates (the same :class:`tritonep.ep.config.EPConfig` goes through the same
        region list and layout function). ``backend``: ``"auto"`` (what it picks on one host: the first registered
        backend, triton) or a registered name (``"nccl"`` holds no symmetric memory: 0). ``tiles`` /
        ``max_programs`` / ``count_columns`` / ``count_topk``: as the constructor (the tiles size a buffer's scratch;
        count columns add the second count matrix, ``count_topk`` the carried routing's region on the decode
        tiles).

        Raises:
            ConfigError / WireError: as the constructor.
        """
        cfg = build_config(world_size=world_size, num_experts=num_experts, hidden=hidden,
                           max_tokens_per_rank=max_tokens_per_rank, topk=topk, dispatch_wire=dispatch_wire,
                           combine_wire=combine_wire, expert_alignment=expert_alignment,
                           max_recv_tokens=max_recv_tokens, backend=backend, dtype=dtype, device_type=device_type,
                           num_sms=num_sms, tiles=tiles, max_programs=max_programs, check_kernels=False,
                           count_columns=count_columns, count_topk=count_topk)
        return backend_required_bytes(backend, cfg)

    # ------------------------------------------------------------------------------------------- calls
    def _check_open(self):
        if self._closed:
            raise BufferStateError("EPBuffer is closed")

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank allocated (0 for the nccl backend)."""
        return self._backend.allocated_bytes

    def expert_out_buffer(self, rows: int | None = None) -> torch.Tensor:
        """The symmetric ``[max_recv_tokens, H]`` region meant for the expert GEMM output (zero copy into combine).

        Args:
            rows: return only the first ``rows`` rows (a view).
        """
        self._check_open()
        t = self._backend.expert_out_buffer()
        return t if rows is None else t[:rows]

    @property
    def tiles(self):
        """The kernel tiles the backend launches with (the triton backend's
        :class:`tritonep.backends.triton.tiles.KernelTiles`: tiles, grids, fused / one-launch roles, combine kind);
        ``None`` for a backend without them (nccl)."""
        return self._backend.tiles

    geometry = property(lambda self: self._backend.tiles, doc="The same as :attr:`tiles`, for callers that read it "
                                                              "under this name (:class:`tritonep.MoEGeometry` is the "
                                                              "model's shape).")

    @property
    def host_reads(self) -> int:
        """Device->host reads this buffer's calls made so far (the eager budget: one per dispatch)."""
        return self._backend.host_reads

    def _rows_of(self, handle) -> int:
        """Rows a combine / backward input must have for ``handle``: the rows received, or for a sync-free handle
        (rows unknown on the host) the ``max_recv_tokens`` rows its dispatch returned (the kernels address any row of
        the layout, up to that bound: a shorter tensor would be read and written past its end)."""
        R = handle.num_recv_rows
        return self.config.max_recv_tokens if R is None else R

    def _check_handle(self, handle):
        """ConfigError unless ``handle`` is a :class:`DispatchHandle` stamped by this buffer's dispatch."""
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != self._id:
            raise ConfigError("handle does not come from this buffer's dispatch (a handle is only valid with the "
                              "EPBuffer that made it)")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 keep_quantized: bool = False, *, sync_free: bool = False, forward_ad: bool = True,
                 count_ids: torch.Tensor | None = None, count_experts: int = 0,
                 count_weights: torch.Tensor | None = None) -> Dispatched:
        """Send every token to the ranks of its experts; return the expert-grouped rows of this rank's experts.

        Args:
            x: ``[T, H]`` bfloat16, ``T <= max_tokens_per_rank`` (T may be 0). Non-contiguous input is copied.
            topk_idx: ``[T, K]`` int32/int64 expert ids in ``[-1, E)``; -1 = no expert. On a buffer whose ``topk``
                is its world size W, also a bool rank mask ``[T, W]``: route k goes to expert ``k * L`` (rank k's
                first local expert) where set, else nowhere (DeepEP's ``is_token_in_rank`` as a routing: the
                compat Buffer's rows lane; read by the decode tiles' kernel itself, made ids on the other paths).
            topk_weights: ``[T, K]`` float (converted to float32), applied in combine.
            keep_quantized: with a quantized dispatch wire, return the quantized rows (``x``: uint8 payload
                ``[R, payload_bytes]``, e.g. e4m3 / e5m2 bits ``[R, H]``, packed e2m1 ``[R, H/2]``) and
                ``x_scales`` (``[R, H/block]`` of the wire's scale dtype: fp32 / e8m0 uint8) instead of bf16 rows;
                the rows carry no gradient (``x`` gets none through them), the row ``weights`` do (the combine's
                gradient of ``topk_weights``).
            sync_free: no host read in this call (the ``num_worst_tokens`` convention of DeepEP / Hybrid-EP /
                torchtitan): ``x`` has ``max_recv_tokens`` rows, the real ones are ``[0, expert_offsets[-1])``
                (device), the tail's rows are unspecified and its ``weights`` zero; ``handle.num_recv_rows`` is None.
                Errors of the call (capacity, a peer's bad input, timeouts) are raised by the next call that reads
                the status word (:meth:`check`, or a dispatch without ``sync_free``); a refused call moves no row and
                returns the empty layout on every backend (``num_tokens_per_expert``, ``expert_offsets`` and
                ``weights`` 0, its rows unspecified; its combine gives zeros and both backward passes zero
                gradients: no kernel addresses a row of the refused layout). What graph capture does anyway. Both
                backends (nccl: fixed per-peer packet slots and one all_to_all with equal splits,
                :mod:`tritonep.backends.nccl.sync_free`).
            forward_ad: False refuses forward-mode dual inputs (InputError, the call taking part as refused as for
                any refused input) instead of dispatching their tangents: for a caller whose outputs cannot carry
                a tangent (the custom ops of :mod:`tritonep.ep.ops`).
            count_ids: a second routing, ``[Tc, CK]`` int32/int64 ids over ``count_experts`` experts (expert e on
                rank ``e // (count_experts / W)``; ids outside ``[0, count_experts)`` count nowhere), only counted:
                each rank gets ``handle.count_sums[j]`` = the routes of every rank's ``count_ids`` to its local
                expert j (DeepEP's per-expert receive counts, made by its notify step), read with the call's status
                (no second host read) on the triton backend in an eager call; None elsewhere (the nccl backend, no
                host read). Every rank passes it alike, with the same ``count_experts`` (a per-call argument,
                checked across ranks in the exchange the call runs anyway: each rank's stamp, ``count_experts`` or 0
                without ``count_ids``, rides in its counts exchange on a buffer made with ``count_columns``; ranks
                that disagree are refused on every rank with :class:`tritonep.errors.CountRoutingError`, no row
                moves, no sums are returned, the buffer stays usable; a sync-free call's disagreement is raised by
                the next :meth:`check` or synced dispatch, on the triton backend; the nccl backend checks its synced
                calls only, docs/protocols.md "Host reads"). Needs ``count_columns >= count_experts / W`` and ``Tc <=
                max_tokens_per_rank`` (InputError); its rows need not be the tokens' (a routing only counted). Its
                kernel variant (per ``CK`` and ``count_experts``) is bound on first use, not at construction: make
                one such call eagerly before a graph capture.
            count_experts: the experts of ``count_ids`` (a multiple of W).
            count_weights: the count routing travels with the rows (a buffer whose ``carries_topk`` is True,
                else InputError): ``count_ids`` must then be the tokens' own (``Tc == T``, ``CK <= count_topk``) and
                ``count_weights`` their float32 ``[T, CK]`` weights; every row this rank receives gets its token's
                ids local to this rank (``id - rank * count_experts / W`` for an id of this rank, else -1) and
                weights (0 where -1), in row order: ``handle.carried = (idx, weights)``, ``[R, CK]`` of
                ``count_ids``' dtype and float32 (R as the rows: ``max_recv_tokens`` when unknown on the host, the
                rows past the received ones -1 and 0), written by the dispatch's own launch. What DeepEP's dispatch
                returns as ``recv_topk_idx`` / ``recv_topk_weights`` when the rows are one per (token, receiving
                rank). Not differentiable (the weights are data here).

        Returns:
            :class:`Dispatched` (rows ordered by (source rank, token, k) inside each expert segment).

        Differentiable w.r.t. ``x`` and ``topk_weights`` in reverse mode (autograd) and forward mode
        (``torch.autograd.forward_ad`` dual tensors: ``x`` and ``weights`` carry the dispatch of the tangents, one
        more dispatch along this call's routing; every rank must pass dual tensors alike, as the extra call is a
        collective; not with ``keep_quantized``: InputError).

        Raises:
            InputError: bad dtype / shape / device / expert id of THIS rank's input (the value is named).
            PeerInputError: another rank's input to this call was refused (its rank is named).
            CountRoutingError: the ranks passed different count routings (``count_ids`` on some ranks only, or
                different ``count_experts``; a PeerInputError raised on every rank, naming them).
            CapacityError: ``T > max_tokens_per_rank`` or more rows than ``max_recv_tokens`` (nothing is sent).
            PeerTimeoutError: a peer never arrived; the buffer is unusable afterwards.
            BufferStateError: closed or broken buffer.

        A refused input is an error on EVERY rank for that call (docs/protocols.md (host protocol rule)): the refusing rank still runs the
        call's launch sequence with no tokens and a flag in its counts row, the flag reaches every rank with the
        counts exchange (no extra collective), no rows move anywhere, the buffer stays usable and the next call
        pairs correctly. Ids outside ``[-1, E)`` are found on the device in the same exchange (no host read of
        ``topk_idx``). Eagerly (``sync_checks`` deferred or strict) every rank raises in this call; with sync
        checks off or under graph capture the refusing rank raises at once and the peers at their next
        :meth:`check`, and until then their rows of this call are unspecified (``weights`` past
        ``expert_offsets[-1]`` are zero). The peers then go on to their :meth:`combine` of this call, so the
        refusing rank must take part in it: call :meth:`cancel_combine` (no handle) where its peers combine
        (:attr:`last_dispatch_read` says whether the refusal was read: False here; ``MoELayer`` does it); their
        output is NaN and every rank's next :meth:`check` raises :class:`PeerInputError` naming the refusing rank
        (the refusing rank included: its own error was raised at the call).
        """
        if self._closed:
            self._check_open()
        if sync_free and not self._backend.sync_free:
            raise ConfigError(f"dispatch(sync_free=True) is not supported by this buffer's backend "
                              f"{self.backend!r}")
        refused, dual = None, False
        try:
            x, topk_idx, topk_weights = check_dispatch_inputs(x, topk_idx, topk_weights, *self._din)
            dual = has_tangent(x, topk_weights)  # forward-mode AD: the tangents are dispatched too (DispatchFn.jvp)
            if dual and not forward_ad:
                raise InputError(_NO_TANGENT.format(what="this dispatch (forward_ad=False: its caller, e.g. the "
                                                         "tritonep::dispatch op, cannot return a tangent)"))
            if dual and keep_quantized and self._quantized_dispatch:
                raise InputError(_NO_TANGENT.format(what="dispatch(keep_quantized=True) (quantized rows carry no "
                                                         "tangent; dispatch without keep_quantized)"))
            count = None if count_ids is None else check_count_ids(count_ids, count_experts, self.config, self.device,
                                                                   count_weights, self.carries_topk,
                                                                   x.shape[0] if count_weights is not None else 0)
            if count_ids is None and count_weights is not None:
                raise InputError("count_weights carries a count routing: pass count_ids too")
        except (InputError, CapacityError) as e:
            refused = e
            x, topk_idx, topk_weights = self._no_input
            count = None
        if sync_free:
            sync = envs.SYNC_NONE  # no read (the backend's sync-free path)
        else:  # whether this call reads its status word: the buffer's sync-checks mode (the backend's end-of-call
            sync = self._sync  # check follows it), SYNC_NONE (0) while capturing
            if sync and self._cuda and torch._C._cuda_isCurrentStreamCapturing():
                sync = envs.SYNC_NONE
        kq = keep_quantized and self._quantized_dispatch
        try:
            if refused is not None or not (dual or torch.is_grad_enabled() and (
                    (x.requires_grad and not kq) or topk_weights.requires_grad)):
                out, out_w, ntpe, offs, handle = self._backend.dispatch_fwd(x, topk_idx, topk_weights, sync, kq,
                                                                         refused is not None, sync_free, count)
            else:  # kept quantized rows carry no gradient; the row weights do (the combine sums w * expert_out)
                box: list = []
                out, out_w, ntpe, offs = DispatchFn.apply(x.detach() if kq else x, topk_weights, self._backend,
                                                          topk_idx, sync, sync_free, box, count, kq)
                handle = box[0]
        except TritonEPError as e:
            self._last_synced = True  # raised after the call's read: its peers raise in this call too
            if refused is not None and isinstance(e, (PeerInputError, CapacityError)):
                # this rank's own error names its value (a CapacityError here is an earlier refusal nobody read:
                raise refused from None  # the code is the first unread refusal's)
            raise
        if refused is not None:  # nothing read (sync-free, sync checks off, graph capture): the peers learn it at
            self._last_synced = False  # their next check() and go on to their combine (cancel_combine takes part)
            raise refused
        self._last_synced = handle.num_recv_rows is not None  # what cancel_combine assumes without a handle
        return Dispatched(out, ntpe, offs, handle, out_w, handle.x_scales)  # positional: x, num_tokens_per_expert,
        # expert_offsets, handle, weights, x_scales (the dataclass's order; half the host time of keywords)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, kind: str | None = None, *,
                forward_ad: bool = True) -> torch.Tensor:
        """Bring expert outputs back: ``y[t] = sum_k topk_weights[t, k] * expert_out[row(t, k)]`` (fp32 sums).

        Args:
            expert_out: ``[R', H]`` bfloat16 with ``R' >=`` the dispatch's rows (e.g. :meth:`expert_out_buffer`).
            handle: the ``Dispatched.handle`` of the matching dispatch.
            kind: ``"push"`` | ``"pull"`` to override the kernel-tile table (triton backend); must be the same on
                every rank (a per-call argument cannot be checked without a collective).
            forward_ad: False refuses forward-mode dual inputs (InputError, taking part as refused) instead of
                returning their tangent (see :meth:`dispatch`).

        Returns:
            ``[T, H]`` in ``expert_out``'s dtype; tokens without a valid route get zeros. Summation order is fixed
            (per rank k ascending, then ranks ascending): bitwise reproducible. Differentiable w.r.t.
            ``expert_out`` and the dispatch's ``weights`` in reverse and forward mode (dual tensors: the tangent is
            ``sum over the token's rows of w * d_expert_out + d_w * expert_out``, one more collective; every rank
            passes dual tensors alike).

        A refused input (this rank raises InputError / ConfigError) still takes part in the call
        (:meth:`cancel_combine`), so no peer waits for this rank: an eager combine (its dispatch read the host) raises
        :class:`PeerInputError` on every other rank; otherwise their output is NaN and their next :meth:`check` or
        synced call raises. Likewise a peer that never arrives: PeerTimeoutError in an eager call, else NaN and the
        next read. An eager combine reads its status once at its end (one host read; ``sync_checks`` not none).

        Raises:
            InputError / ConfigError: this rank's input or handle (refused on every rank, see above).
            PeerInputError: a peer's combine input was refused (or it cancelled: :meth:`cancel_combine`).
            BufferStateError, PeerTimeoutError (see :meth:`dispatch`).
        """
        if self._closed:
            self._check_open()
        if "refused_here" in getattr(handle, "__dict__", ()) and handle.buffer_id == self._id:
            # the handle of refuse_dispatch without a read: this rank takes part as refused (the peers' output NaN)
            self.cancel_combine(handle, kind if kind in ("push", "pull") else None)
            return torch.full((0, self.hidden), float("nan"), dtype=self.dtype, device=self.device)
        try:
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != self._id:
                self._check_handle(handle)
            R = handle.num_recv_rows  # _rows_of(handle), inline
            expert_out = check_combine_inputs(expert_out, handle, *self._cin,
                                              self.config.max_recv_tokens if R is None else R)
            if kind is not None and kind not in ("push", "pull"):
                raise ConfigError(f"combine kind={kind!r} is not 'push' or 'pull'")
            if not forward_ad and has_tangent(expert_out, handle.recv_weights):
                raise InputError(_NO_TANGENT.format(what="this combine (forward_ad=False: its caller, e.g. the "
                                                         "tritonep::combine op, cannot return a tangent)"))
        except (InputError, ConfigError):
            # refused on this rank: it still takes part (host protocol rule), so every peer's combine fails too
            # (raises in an eager call, NaN output and a recorded error otherwise) instead of waiting for it
            self.cancel_combine(handle if isinstance(handle, DispatchHandle) else None, kind)
            raise
        # an eager combine (the handle's dispatch read the host) reads its status once at its end: a peer that
        # refused the call or never arrived raises here, on every rank, never a value computed without its data
        read = R is not None and self._reads_combine()
        rw = handle.recv_weights
        if torch.is_grad_enabled() and (expert_out.requires_grad or (rw is not None and rw.requires_grad)) or \
                has_tangent(expert_out, rw):  # forward-mode AD: CombineFn.jvp
            return CombineFn.apply(expert_out, rw, self._backend, handle, kind, read)
        return self._backend.combine_fwd(expert_out, handle, kind=kind, read=read)

    def _reads_combine(self) -> bool:
        """Whether a combine of a synced handle reads its status now (the config's sync checks not ``none``, not
        capturing)."""
        return self._sync != envs.SYNC_NONE and not (self._cuda and torch.cuda.is_current_stream_capturing())

    def counts_exchange(self, num_experts: int | None = None):
        """A new counts exchange of this buffer's backend (collective: every rank builds it, in the same order).

        ``gather(topk_idx [T, K]) -> int32 [W, num_experts]`` routes of every rank per expert (the virtual-expert
        planner's input); identical bits on every backend (:class:`tritonep.backends.CountsExchange`).

        Args:
            num_experts: experts the histogram spans (default: this buffer's E), a multiple of the group size.

        Raises:
            ConfigError: ``num_experts`` not a positive multiple of the world size. BufferStateError: closed.
        """
        self._check_open()
        E = self.num_experts if num_experts is None else num_experts
        if not isinstance(E, int) or E < 1 or E % self.world_size:
            raise ConfigError(f"num_experts={E!r} is not a positive multiple of world_size={self.world_size}")
        return self._backend.counts_exchange(E)

    def expert_transport(self, num_experts: int, shapes: dict, dtype: torch.dtype = torch.bfloat16):
        """A new virtual-expert weight transport of this buffer's backend (collective, like the constructor).

        Args:
            num_experts: E of the weights (L = E / world_size native experts and L virtual slots per rank).
            shapes: ``name -> per-expert shape``, e.g. ``{"w1": (H, 2*I), "w2": (I, H)}``.
            dtype: weight dtype (bf16 or fp32).

        Returns:
            a :class:`tritonep.backends.ExpertTransport` (push / slot_views / pull), same bits on every backend.

        Raises:
            PlanError: ``num_experts`` not divisible by the world size. BufferStateError: closed.
        """
        self._check_open()
        return self._backend.expert_transport(num_experts, shapes, dtype)

    def close(self):
        """Release the buffer (collective: every rank closes its buffers in the same order)."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _front_property(name: str):
    """A read-only property of EPBuffer giving its config's field ``name`` (one attribute read)."""
    return property(operator.attrgetter("config." + name),
                    doc=f"The buffer's ``config.{name}`` (:class:`tritonep.ep.config.EPConfig`).")


for _name in EPConfig.FRONT:
    setattr(EPBuffer, _name, _front_property(_name))
del _name
