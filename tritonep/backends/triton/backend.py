"""The Triton backend of EPBuffer: symmetric memory + the kernels of :mod:`tritonep.device`.

One symmetric allocation per buffer holds every region (:func:`tritonep.backends.triton.regions.regions`, which also
answers ``EPBuffer.required_bytes``). Everything the static configuration (:class:`tritonep.ep.config.EPConfig`)
decides is computed once at construction: region views, pointer tables, the handle storage layout
(:class:`tritonep.backends.triton.outputs.HandleLayout`) and every kernel launch with its static arguments
(:class:`tritonep.backends.triton.calls.KernelSet`). :class:`TritonEP` is one class composed of parts with their own
state, each built once, in this order: the outputs (:class:`tritonep.backends.triton.outputs.DispatchOutputs`: the
handle layout, every output pool, rows), the call status (:class:`tritonep.backends.triton.status.CallStatus`: status
word, host read, verdicts, errors), the bound launches, and the paths a call takes: the staged launches
(:class:`tritonep.backends.triton.staged.StagedPath`, where the launch sequence of each call is written down) and,
with decode tiles, the one-launch dispatch and push combine (:class:`tritonep.backends.triton.decode.DecodePath`).

:class:`TritonEP` itself launches nothing: a call checks that the buffer is usable, picks the path and the combine
kind, and hands over. A call validates nothing the front door did not, allocates its handle storage (one tensor, whose
fields reach the kernels as addresses: :class:`tritonep.runtime.field_view.FieldView`) and outputs, launches, and
returns views.
"""

from __future__ import annotations

import torch

from ...envs import SYNC_NONE
from ...memory import get_heap, group_barrier
from ...runtime.launch import Launch
from ...runtime.status import wait_bound
from ...wire.formats import get_wire
from .calls import RAW, KernelSet
from .decode import DecodePath
from .outputs import DispatchOutputs
from .regions import RegionViews, regions
from .staged import StagedPath
from .status import CallStatus

__all__ = ["TritonEP"]


class TritonEP:
    """Triton + symmetric-memory implementation behind :class:`tritonep.EPBuffer` (see the module docstring).

    Args:
        cfg: the buffer's :class:`tritonep.ep.config.EPConfig` (read, never re-derived).
        group: the EP group; rank: this rank; device: its device.

    Attributes (its parts): ``outputs`` (:class:`tritonep.backends.triton.outputs.DispatchOutputs`), ``call_status``
    (:class:`tritonep.backends.triton.status.CallStatus`), ``k`` (:class:`tritonep.backends.triton.calls.
    KernelSet`, every launch bound once), ``staged`` (:class:`tritonep.backends.triton.staged.StagedPath`),
    ``decode`` (:class:`tritonep.backends.triton.decode.DecodePath`, or None off the decode tiles); and the
    symmetric allocation ``buf`` with its region views.
    """

    name = "triton"
    sync_free = True  # dispatch(sync_free=True): no host read, max_recv_tokens rows
    sums_counts = True  # dispatch(count_ids=...): the sums come with the status (a buffer with count_columns)

    def __init__(self, cfg, *, group, rank, device):
        self.cfg, self.group, self.rank, self.device = cfg, group, rank, torch.device(device)
        self.dfmt = get_wire(cfg.dispatch_wire, "dispatch_wire")
        self.dwire, self.cwire = self.dfmt.codec, get_wire(cfg.combine_wire, "combine_wire").codec  # kernels' WIRE
        self.buf = get_heap(group, self.device).allocate(regions(cfg))
        self.views = v = RegionViews(self.buf)  # what the launches are bound to
        self.flags, self.status, self.calls = v.flags, v.status, v.calls
        # the handle storage layout and every pool of per-call outputs reused once nobody holds them
        # (runtime/pool.py): the staged tiles' handle storage blocks, the decode tiles' shared ones
        self.outputs = DispatchOutputs(cfg, self.dfmt, self.device)
        self.hl = hl = self.outputs.hl
        # every launch bound once (KernelSet), reported to the recorder, its grid within the program cap
        self._launch = Launch(self.device, max_programs=cfg.max_programs, mode=cfg.launch)
        self.call_status = CallStatus(cfg, rank, self.device, self.status, self._launch)
        self.k = KernelSet(cfg, v, hl, self._launch, rank=rank, device=self.device,
                           timeout=wait_bound(self.device, cfg.timeout_s), host_mapped=self.call_status.mapped,
                           dwire=self.dwire)
        # the handle a refused combine runs with (no token, no received row: its launches move nothing and only
        # take part in the protocol, :meth:`combine_refused`)
        self._empty = self.outputs.new_handle()
        self._empty._fill(torch.zeros(hl.numel, dtype=torch.int32, device=self.device), hl, 0, 0, 0, None, None)
        self._no_w = torch.zeros(1, dtype=torch.float32, device=self.device)  # the weighted combine's unused gw_ptr
        # the paths a call takes: the staged launches (every tiles: the combine backward; and the decode tiles'
        # pull combine), the decode tiles' one-launch dispatch and push combine
        parts = (cfg, self.k, self.call_status, self.outputs, self.device, self._no_w)
        dec = bool(cfg.tiles.decode)
        self.staged = StagedPath(*parts)
        self.decode = DecodePath(*parts) if dec else None
        # a combine without a kind override is the decode tiles' one launch (as _combine decides it)
        self._decode_push = dec and (cfg.tiles.combine == "push" or self.cwire.quantized)
        self._no_rows = torch.zeros(1, cfg.hidden, dtype=cfg.dtype, device=self.device)  # a refused call's row args
        self._precompile(group)

    # ---------------------------------------------------------------------------------------------- state
    buffer_id = property(lambda self: self.outputs.buffer_id, lambda self, v: setattr(self.outputs, "buffer_id", v),
                         doc="The owning EPBuffer's id (set by it; handles carry it).")
    host_reads = property(lambda self: self.call_status.host_reads,
                          doc="Device->host reads the calls made so far (the eager budget: one per dispatch).")
    broken = property(lambda self: self.call_status.broken,
                      doc="Why the buffer is unusable (a wait that gave up, closed), or None.")

    def output_pools(self) -> tuple:
        """The output pools this buffer takes sets from (:mod:`tritonep.runtime.pool`; shared ones included)."""
        return self.outputs.pools()

    @property
    def output_pool_bytes(self) -> int:
        """Device bytes the output pools this buffer uses hold (outside the symmetric heap; the shared pools of the
        decode rows / combine output counted whole: :mod:`tritonep.runtime.pool`)."""
        return sum(p.nbytes for p in self.output_pools())

    def expert_out_buffer(self) -> torch.Tensor:
        """The symmetric ``[max_recv_tokens, H]`` expert-output region (zero copy into combine)."""
        return self.buf.local("expert_out")

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes of this rank's allocation (0 once closed)."""
        return self.buf.nbytes if self.buf is not None else 0

    def counts_exchange(self, num_experts: int):
        """A new counts exchange over this backend's group through symmetric memory
        (:class:`tritonep.backends.triton.counts.CountsExchange`; collective)."""
        from .counts import CountsExchange

        cfg = self.cfg
        return CountsExchange(self.group, num_experts, cfg.max_tokens_per_rank, cfg.topk, self.device,
                              timeout_s=cfg.timeout_s, max_programs=cfg.max_programs, launch=cfg.launch)

    def expert_transport(self, num_experts: int, shapes: dict, dtype: torch.dtype):
        """A new virtual-expert weight transport over this backend's group through symmetric memory
        (:class:`tritonep.backends.triton.expert_transport.ExpertTransport`; collective)."""
        from .expert_transport import ExpertTransport

        return ExpertTransport(self.group, num_experts, shapes, dtype=dtype, device=self.device,
                               timeout_s=self.cfg.timeout_s, max_programs=self.cfg.max_programs,
                               launch=self.cfg.launch)

    @property
    def tiles(self):
        """The :class:`tritonep.backends.triton.tiles.KernelTiles` every launch of this buffer uses (the config's)."""
        return self.cfg.tiles

    @property
    def timeout_s(self) -> float:
        """The bound of every wait of this buffer, seconds (the config's)."""
        return self.cfg.timeout_s

    def check(self, what="EPBuffer"):
        """Read the status word on the host and raise its typed error (one sync; :meth:`CallStatus.check`)."""
        self.call_status.check(what)

    # ---------------------------------------------------------------------------------------------- construction
    def _precompile(self, group):
        """Compile every kernel variant this buffer can launch (GPU), then one barrier of the group (every device).

        The dry run walks the real code paths (dispatch with int32 and int64 ids, with and without keep_quantized,
        push and pull combine, both backwards) with every launch turned into ``kernel.warmup``
        (:meth:`tritonep.runtime.launch.Launch.dry_run`), and puts the call counters and status back. No call ever
        compiles-and-barriers lazily (docs/protocols.md, host protocol rule).
        """

        def walk():
            cfg, dev = self.cfg, self.device
            T, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk
            x = torch.zeros(T, H, dtype=cfg.dtype, device=dev)
            w = torch.zeros(T, K, dtype=torch.float32, device=dev)
            for id_dtype in (torch.int64, torch.int32):
                idx = torch.zeros(T, K, dtype=id_dtype, device=dev)
                for kq in ([False, True] if self.dwire.quantized else [False]):
                    out, out_w, _, _, handle = self.dispatch_fwd(x, idx, w, sync=SYNC_NONE, keep_quantized=kq)
            eo = self.expert_out_buffer()
            for kind in ("push", "pull"):
                self._combine(eo, handle, weighted=True, kind=kind, wire=self.cwire)
            self.dispatch_bwd(eo, None, handle)
            self.dispatch_bwd(eo, out_w, handle)
            self.combine_bwd(x, eo, handle)

        self._launch.dry_run(walk, restore=(self.calls, self.status))
        group_barrier(group, self.device)  # NCCL or gloo (ranks that share a GPU)

    # ---------------------------------------------------------------------------------------------- dispatch
    def dispatch_fwd(self, x, topk_idx, topk_weights, sync: int, keep_quantized: bool = False,
                     bad_input: bool = False, sync_free: bool = False, count=None):
        """Forward dispatch, on the decode tiles' one launch or the staged launches (their launch sequences:
        :mod:`tritonep.backends.triton.decode`, :mod:`tritonep.backends.triton.staged`).

        ``sync``: the call's ``TRITONEP_SYNC_CHECKS`` mode, read once by the front door (``envs.SYNC_NONE`` = 0: no
        host read, e.g. under capture; ``SYNC_DEFERRED``: one read; ``SYNC_STRICT``: also a check at the end).
        ``sync_free``: ``dispatch(sync_free=True)``; here the same path as ``sync`` 0 (no read, ``max_recv_tokens``
        rows, the rows past the received ones with weight 0), which the front door passes with it.

        ``bad_input=True``: the front door refused this rank's input; ``x``/``topk_idx``/``topk_weights`` are
        empty and the rank still runs the whole launch sequence, flagging the refusal in its counts row, so every
        rank fails this call together (:class:`PeerInputError`) and the next call pairs correctly.

        ``count``: None or ``(count_ids, count_experts, Tc, CK)``, the count routing of
        :meth:`tritonep.EPBuffer.dispatch`, exchanged with the counts (the decode tiles' one launch, or the counts
        exchange launch): ``handle.count_sums`` when ``sync``.

        Returns ``(rows, row_weights, num_tokens_per_expert, expert_offsets, handle)``.

        Raises (eager, ``sync``): PeerInputError / InputError (ids outside ``[-1, E)`` on this rank),
        CapacityError, PeerTimeoutError; no row moves on any rank for the first two.
        """
        status = self.call_status
        if status.broken:
            status.usable()
        T = x.shape[0]
        if not bad_input:
            status.note_ids(topk_idx)
        elif not sync:  # raised at the call; the read that finds it names this rank (CallStatus.front_door_unread)
            status.front_door_unread = True
        if self.decode is not None:
            return self.decode.dispatch(x, topk_idx, topk_weights, sync, keep_quantized, bad_input, T, count)
        return self.staged.dispatch(x, topk_idx, topk_weights, sync, keep_quantized, bad_input, T, count)

    # ---------------------------------------------------------------------------------------------- combine
    def _combine(self, eo, handle, weighted, gw=None, kind=None, wire=RAW, bad=0, ticket=0):
        """A combine (``weighted``) or the dispatch backward (``gw``: the weight gradients' return, push only);
        ``bad``: this rank takes part as refused (:meth:`combine_refused`); ``ticket``: the host reads this call's
        status (:meth:`tritonep.backends.triton.status.CallStatus.after_combine`). The decode tiles' push combine is
        one launch (:class:`tritonep.backends.triton.decode.DecodePath`), every other the staged launches."""
        status = self.call_status
        if status.broken:
            status.usable()
        kind = kind or self.cfg.tiles.combine
        if gw is not None or wire.quantized:
            kind = "push"  # quantized partials and weight-gradient return are push-only
        if self.decode is not None and kind == "push":  # one launch (also the dispatch backward); it advances
            return self.decode.combine(eo, handle, wire, weighted, gw, bad, ticket)  # CALL_COMBINE itself
        return self.staged.combine(eo, handle, wire, weighted, gw, bad, ticket, kind)

    def combine_fwd(self, expert_out, handle, kind=None, read=False):
        """Weighted combine ``y [T, H]`` (as :meth:`_combine` picks its path). ``read``: an eager combine: the host reads the
        call's status once its last launch finished and raises a peer's refusal or timeout (every rank does)."""
        ticket = self.call_status.next_ticket() if read else 0
        if kind is None and self._decode_push and not self.call_status.broken:  # what _combine picks, without its
            return self.decode.combine(expert_out, handle, self.cwire, ticket=ticket)[0]  # branches
        y, _ = self._combine(expert_out, handle, weighted=True, kind=kind, wire=self.cwire, ticket=ticket)
        return y

    def combine_refused(self, kind=None, record_own=True, handle=None):
        """Take part in this call's combine as refused (a refused combine input on this rank, or the caller cancelled
        the combine after a failure of its own): the same launches as the peers' combine with no token and no row,
        which mark the call refused in every peer (their outputs become NaN and their status records it:
        :func:`tritonep.backends.triton.kernels.combine.mark_refused`). ``record_own``: record it in this rank's
        status too (the peers read nothing in this call: sync-free, sync checks off, capture; then the next read
        raises it on every rank, this one included); else the peers' eager read raises it and this rank raises its
        own error (its own read clears what the call recorded here: another rank refused the same call).
        ``handle`` is not needed here (the launches carry no row)."""
        self._combine(self.expert_out_buffer(), self._empty, weighted=True, kind=kind, wire=self.cwire,
                      bad=1 if record_own else 2, ticket=0 if record_own else self.call_status.next_ticket())

    def dispatch_bwd_refused(self, handle=None, with_weights=False):
        """Take part in this call's dispatch backward as refused (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`):
        the peers' launches (the weight-gradient variant with ``with_weights``) with no token and no row, marking the
        call refused in every peer (their outputs NaN, their status records it) and in this rank's status (a
        backward reads nothing on the host: the next read raises it on every rank). ``handle`` is not needed."""
        self._combine(self.expert_out_buffer(), self._empty, weighted=False, gw=self._no_w if with_weights else None,
                      bad=1)

    def defer_refusal(self, error):
        """See :meth:`tritonep.backends.interface.EPBackend.defer_refusal` (:attr:`CallStatus.front_door_unread`)."""
        self.call_status.front_door_unread = error

    # ---------------------------------------------------------------------------------------------- backward
    def dispatch_bwd(self, grad_recv_x, grad_recv_w, handle):
        """grad_x[t] = sum_k grad_recv_x[row(t,k)]; grad_topk_weights[t,k] = grad_recv_w[row(t,k)]."""
        return self._combine(grad_recv_x, handle, weighted=False, gw=grad_recv_w)

    def combine_bwd(self, grad_y, expert_out, handle):
        """grad_expert_out[row] = w * grad_y[t]; grad_recv_w[row] = <grad_y[t], expert_out[row]>."""
        status = self.call_status
        if status.broken:
            status.usable()
        return self.staged.combine_bwd(grad_y, expert_out, handle)

    def combine_bwd_refused(self, handle=None):
        """Take part in this call's combine backward as refused (:meth:`tritonep.EPBuffer.cancel_combine_backward`,
        or a refused ``combine_backward`` input): the peers' two launches, the send with ``T = -1`` (no row moves;
        it writes ``ntok[rank] = -1`` in every rank, the refused mark) and the expand with no output row. Every
        rank's expand that sees the mark moves no row, fills its outputs with NaN and records the refusal
        (``STATUS_COMBINE_REFUSED`` naming this rank; this rank's too: a backward reads nothing on the host, so the
        next read raises it on every rank). ``handle`` is not needed (the launches carry no row)."""
        status = self.call_status
        if status.broken:
            status.usable()
        store, k = self._empty.store, self.k
        k.send_bwd(self._no_rows, store, -1, 0)
        k.expand_bwd(self._no_rows, self._no_rows, store, self._no_rows, self._no_w, self._no_w, 0)
        status.refused_check("combine backward")  # strict mode: the peers raise it in this call

    def close(self):
        """Free the symmetric allocation (collective). Later calls raise :class:`BufferStateError`, also those that do
        not pass the EPBuffer's front door (the autograd backward of a call made before the close): its bound kernels
        hold the freed regions' addresses. The output pools let their blocks go."""
        status = self.call_status
        status.broken = "closed" + (f" (unusable before: {status.broken})" if status.broken else "")
        self.outputs.close()  # the output pools' blocks go with the buffer (a caller's kept outputs stay valid)
        if self.buf is not None:
            self.buf.close()
            self.buf = None
