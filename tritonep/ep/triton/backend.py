"""The Triton backend of EPBuffer: symmetric memory + the kernels of :mod:`tritonep.kernels`.

One symmetric allocation per buffer holds every region (:func:`tritonep.ep.triton.regions.regions`, which also
answers ``EPBuffer.required_bytes``). Everything the static configuration (:class:`tritonep.ep.config.EPConfig`)
decides is computed once at construction: region views, pointer tables, the handle storage layout
(:class:`tritonep.ep.triton.outputs.HandleLayout`) and every kernel launch with its static arguments
(:class:`tritonep.ep.triton.calls.KernelSet`). A call validates nothing the front door did not, allocates its
handle storage (one tensor, whose fields reach the kernels as addresses: :class:`tritonep.ep.field_view.FieldView`)
and outputs, launches, and returns views.

Call sequence of a dispatch (all on the current stream, no host sync except the one optional status read after the
counts exchange, see ``sync``):

1. chunk histograms; the same launch writes the handle's own sanitized copy of the routing (ids outside
   ``[-1, E)`` become -1) and advances ``calls[CALL_DISPATCH]`` / ``calls[CALL_EXCHANGE]`` on the device,
2. counts exchange + layout (one program per expert block); its last program publishes (status, rows received)
   and the call's ticket into pinned host memory (:class:`tritonep.ep.triton.host_status.HostStatus`),
3. [synced calls only] one host read of (status, rows): a spin on the published ticket, no device-to-host copy or
   event -> CapacityError / PeerInputError / PeerTimeoutError before any row moves (the send is queued before the
   host waits, so its NVLink time overlaps the read),
4. send, 5. expand (or 4+5 as one launch when the geometry has ``fused_send > 0``: sends and expands overlap).

Combine: partial (push into the source, or into own memory for pull), output (a weighted push combine runs both
as one launch when the geometry has ``fused_combine``); the call's last launch advances ``calls[CALL_COMBINE]``
itself (no host op; the combine backward's expand likewise advances ``calls[CALL_DISPATCH]``). With the geometry's
``decode`` (small ``max_tokens_per_rank``) the forward dispatch and the weighted push combine are ONE launch each,
counts exchange and counter advances included (:mod:`tritonep.ep.triton.decode`). Combine and both backward passes
read the routing from the handle (its copy), never from the caller's tensors. Every flag row, counter and status
field is named in :mod:`tritonep.kernels.protocol`.
"""

from __future__ import annotations

from collections import deque

import torch

from ... import envs
from ...errors import BufferStateError, InputError, PeerTimeoutError, TritonEPError
from ...kernels import protocol as P
from ...memory import get_heap, group_barrier
from ...wire.formats import get_wire
from ..status import (STATUS_BAD_INPUT, STATUS_CAPACITY, STATUS_COMBINE_REFUSED, bad_ranks, raise_for_status,
                      wait_bound)
from ..validate import check_expert_ids
from .calls import RAW, KernelSet
from .decode import DecodePath
from .host_status import HostStatus
from .launch import Launcher
from .outputs import ST_HOST, DispatchOutputs, HandleLayout
from ..pool import OutputPool, acquire_shared, release_shared
from .regions import regions

__all__ = ["TritonEP"]

_ST_ERR = P.v(P.STATUS_WORDS)  # the status word's error part
_CODE = P.v(P.ST_CODE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _decode_set_maker(hl: HandleLayout, rows: int, H: int, dtype: torch.dtype, device: torch.device):
    """``make()`` of the decode geometry's shared pool (:mod:`tritonep.ep.pool`): ``(store, rows), (row weights,
    ntpe, offs)``, the handle block of layout ``hl`` and the ``[rows, H]`` rows; the row weights first among the views
    (the pool's quick test reads them: a caller's kept weights or handle hold them). It holds no buffer: the pool
    outlives the buffer that made it while another buffer of the shape uses it."""
    def make():
        store = hl.new(device)
        return ((store, torch.empty(rows, H, dtype=dtype, device=device)),
                (hl.tensor(store, "rw"), hl.tensor(store, "ntpe"), hl.tensor(store, "offs")))
    return make


class TritonEP(DispatchOutputs, DecodePath):
    """Triton + symmetric-memory implementation behind :class:`tritonep.EPBuffer` (see the module docstring).

    Args:
        cfg: the buffer's :class:`tritonep.ep.config.EPConfig` (read, never re-derived).
        group: the EP group; rank: this rank; device: its device.
    """

    name = "triton"

    def __init__(self, cfg, *, group, rank, device):
        self.cfg, self.rank, self.device = cfg, rank, torch.device(device)
        self.dfmt = get_wire(cfg.dispatch_wire, "dispatch_wire")
        self.dwire, self.cwire = self.dfmt.codec, get_wire(cfg.combine_wire, "combine_wire").codec  # kernels' WIRE
        self.buf = get_heap(group, self.device).allocate(regions(cfg))
        b = self.buf
        self.flags, self.status, self.calls = b.local("flags"), b.local("status"), b.local("calls")
        self.hist, self.pre = b.local("hist"), b.local("pre")
        self.send_base, self.rows_needed = b.local("send_base"), b.local("rows_needed")
        self.tab = {n: b.ptr_table(n) for n in ("flags", "counts", "ntok", "meta", "wts", "wback", "stage",
                                                 "cstage", "cflag", "ccflag", "cbad")}
        self.timeout = wait_bound(self.device, cfg.timeout_s)
        self.broken: str | None = None
        self.host_reads = 0  # device->host reads made by calls (the eager-path budget: one per dispatch)
        self.buffer_id = 0  # set by the EPBuffer that owns this backend (handles carry it)
        # every dispatch publishes its status words + the call's ticket here (the counts exchange's last program, or
        # the decode kernel's program 0; pinned: the kernel stores into it through unified addressing; CPU: the
        # interpreter writes it directly): HostStatus.read spins on the ticket, no device-to-host copy
        self.st_mapped = torch.zeros(ST_HOST + 1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.host_status = HostStatus(self.st_mapped, ST_HOST, self.rank, cfg.timeout_s)
        self._recent_idx: deque = deque(maxlen=4)  # the last dispatches' topk_idx: check() names a bad id by value
        self.hl = HandleLayout(cfg)
        # the handle a refused combine runs with (no token, no received row: its launches move nothing and only
        # take part in the protocol, :meth:`combine_refused`)
        self._empty = self._new_handle()
        self._empty._fill(torch.zeros(self.hl.numel, dtype=torch.int32, device=self.device), self.hl, 0, 0, 0, None,
                          None)
        self._no_rows = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=self.device)
        self._no_w = torch.zeros(1, dtype=torch.float32, device=self.device)  # the weighted combine's unused gw_ptr
        self._launch = Launcher(self.device, group)
        self.k = KernelSet(self)
        # per-call outputs reused once nobody holds them (pool.py). Two-kernel / fused geometry: this buffer's handle
        # storage blocks and the views a dispatch returns of them. Decode geometry: ONE pool shared by every buffer of
        # the same shape (one per MoE layer: run one at a time) whose sets hold the handle block AND the
        # max_recv_tokens rows (one take per call), and one of the combine's [Tmax, H] outputs
        slots = envs.output_pool()
        dec = bool(cfg.geometry.decode)
        dev, H, dt = self.device, cfg.hidden, cfg.dtype
        self._pool = OutputPool(self._make_set, 0 if dec else slots, dev)
        hl = self.hl
        self._shared = (("dec", str(dev), cfg.max_recv_tokens, H, dt, hl.numel, tuple(hl.fields)),
                        ("y", str(dev), cfg.max_tokens_per_rank, H, dt))
        self._shared_slots = slots if dec else 0  # what this buffer registered with the shared pools (0: none)
        self._dpool = acquire_shared(self._shared[0], _decode_set_maker(hl, cfg.max_recv_tokens, H, dt, dev),
                                     self._shared_slots, dev)
        Tm = cfg.max_tokens_per_rank
        self._ypool = acquire_shared(self._shared[1], lambda: ((torch.empty(Tm, H, dtype=dt, device=dev),), ()),
                                     self._shared_slots, dev)
        # a combine without a kind override is the decode geometry's one launch (as _combine decides it)
        self._decode_push = dec and (cfg.geometry.combine == "push" or self.cwire.quantized)
        self._precompile(group)

    # ---------------------------------------------------------------------------------------------- helpers
    def _make_set(self):
        """A new set of the two-kernel / fused geometry's output pool: ``(store,), (ntpe, offs, row weights)``
        (all fields whole)."""
        hl = self.hl
        store = hl.new(self.device)
        return (store,), (hl.tensor(store, "ntpe"), hl.tensor(store, "offs"), hl.tensor(store, "rw"))

    def output_pools(self) -> tuple:
        """The output pools this buffer takes sets from (:mod:`tritonep.ep.pool`; shared ones included)."""
        return self._pool, self._dpool, self._ypool

    @property
    def output_pool_bytes(self) -> int:
        """Device bytes the output pools this buffer uses hold (outside the symmetric heap; the shared pools of the
        decode rows / combine output counted whole: :mod:`tritonep.ep.pool`)."""
        return sum(p.nbytes for p in self.output_pools())

    def expert_out_buffer(self) -> torch.Tensor:
        """The symmetric ``[max_recv_tokens, H]`` expert-output region (zero copy into combine)."""
        return self.buf.local("expert_out")

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes of this rank's allocation (0 once closed)."""
        return self.buf.nbytes if self.buf is not None else 0

    @property
    def geometry(self):
        """The :class:`tritonep.ep.geometry.Geometry` every launch of this buffer uses."""
        return self.cfg.geometry

    @property
    def timeout_s(self) -> float:
        """The bound of every wait of this buffer, seconds (the config's)."""
        return self.cfg.timeout_s

    def _check_usable(self):
        if self.broken:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is unusable: {self.broken}")

    def check(self, what="EPBuffer"):
        """Read the status word on the host and raise its typed error (one sync).

        A refusal (capacity, a bad input, a refused combine) is reported once and cleared (the buffer stays usable);
        a timeout makes it unusable.
        """
        self.host_reads += 1
        self._raise_words(self.status[:_ST_ERR].cpu().clone(), what)  # .cpu() of a CPU tensor is the tensor itself

    def _raise_words(self, st, what):
        """Raise the typed error of the status words ``st`` (host int64 ``[8]``; nothing for an OK word): a refusal
        is cleared on the device (reported once), a timeout marks the buffer unusable."""
        st = torch.as_tensor(st, dtype=torch.int64)
        code = int(st[_CODE])
        if code in (STATUS_CAPACITY, STATUS_BAD_INPUT, STATUS_COMBINE_REFUSED):
            self.status.zero_()
            if code != STATUS_COMBINE_REFUSED and self.rank in bad_ranks(st):
                self._raise_own_bad_ids()  # this rank's ids in a refused call (the code may be an earlier one's)
        try:
            raise_for_status(st, self.rank, self.cfg.max_recv_tokens, what, self.cfg.timeout_s, self.device.type)
        except PeerTimeoutError as e:
            self.broken = str(e)
            raise

    def _raise_own_bad_ids(self):
        """This rank's input was refused on the device (sync checks off): raise InputError naming the value, from
        the most recent of the last dispatches' ``topk_idx`` that holds an id outside ``[-1, E)`` (the caller's
        tensors, kept only to name the value: a caller that refilled them in place may see another value named)."""
        for idx in reversed(self._recent_idx):
            check_expert_ids(idx, self.cfg.num_experts)
        raise InputError(f"rank {self.rank}: the topk_idx of an earlier dispatch held an id outside "
                         f"[-1, num_experts={self.cfg.num_experts}) (found on the device; no longer held to name "
                         f"the value)")

    def _eager_check(self, what):
        """Strict eager calls (TRITONEP_SYNC_CHECKS=1, not capturing) raise a wait the kernels gave up on in the same
        call (one sync). By default (deferred) the next dispatch's one host read raises it instead.
        """
        if envs.sync_checks() != envs.SYNC_STRICT or self._launch.warming or (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        self.check(what)

    def _read_host_status(self, ticket: int) -> list:
        """The one host read of a synced dispatch: the status words its launch published with ``ticket`` (a spin
        on pinned memory, no copy or event). A read that gives up (the launch never ran) makes the buffer unusable,
        as a kernel's own wait that gave up does: the launch may still run later and would pair with nothing."""
        self.host_reads += 1
        try:
            return self.host_status.read(ticket)
        except PeerTimeoutError as e:
            self.broken = str(e)
            raise

    # ---------------------------------------------------------------------------------------------- construction
    def _precompile(self, group):
        """Compile every kernel variant this buffer can launch (GPU), then one barrier of the group (every device).

        The dry run walks the real code paths (dispatch with int32 and int64 ids, with and without keep_quantized,
        push and pull combine, both backwards) with every launch turned into ``kernel.warmup``
        (:meth:`Launcher.dry_run`), and puts the call counters and status back. No call ever compiles-and-barriers
        lazily (docs/protocols.md, host protocol rule).
        """

        def walk():
            cfg, dev = self.cfg, self.device
            T, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.topk
            x = torch.zeros(T, H, dtype=cfg.dtype, device=dev)
            w = torch.zeros(T, K, dtype=torch.float32, device=dev)
            for id_dtype in (torch.int64, torch.int32):
                idx = torch.zeros(T, K, dtype=id_dtype, device=dev)
                for kq in ([False, True] if self.dwire.quantized else [False]):
                    out, out_w, _, _, handle = self.dispatch_fwd(x, idx, w, sync=False, keep_quantized=kq)
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
                     bad_input: bool = False):
        """Forward dispatch (see the module docstring for the launch sequence).

        ``sync``: the call's ``TRITONEP_SYNC_CHECKS`` mode, read once by the front door (``envs.SYNC_NONE`` = 0: no
        host read, e.g. under capture; ``SYNC_DEFERRED``: one read; ``SYNC_STRICT``: also a check at the end).

        ``bad_input=True``: the front door refused this rank's input; ``x``/``topk_idx``/``topk_weights`` are
        empty and the rank still runs the whole launch sequence, flagging the refusal in its counts row, so every
        rank fails this call together (:class:`PeerInputError`) and the next call pairs correctly.

        Returns ``(rows, row_weights, num_tokens_per_expert, expert_offsets, handle)``.

        Raises (eager, ``sync``): PeerInputError / InputError (ids outside ``[-1, E)`` on this rank),
        CapacityError, PeerTimeoutError; no row moves on any rank for the first two.
        """
        if self.broken:
            self._check_usable()
        g = self.cfg.geometry
        T = x.shape[0]
        if not bad_input:
            self._recent_idx.append(topk_idx)
        if g.decode:
            return self._dispatch_decode(x, topk_idx, topk_weights, sync, keep_quantized, bad_input, T)
        # the pool's set (store, ntpe, offs, row weights) or None: allocate as before (graph capture, every set held)
        got = self._pool.take()
        if got is not None:
            store, ntpe, offs, rw = got
        else:
            store, ntpe, offs, rw = self.hl.new(self.device), None, None, None
        k = self.k
        nc = _cdiv(T, g.bt)
        ticket = self.host_status.ticket(sync)  # only a read takes one (HostStatus.next_ticket says why)
        k.hist(topk_idx, topk_weights, store, T, nc)
        k.exchange(nc, store, int(bad_input), ticket)  # publishes status + ticket to the host
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
        handle = self._new_handle()
        st = self._read_host_status(ticket) if sync else None  # the exchange's last program published it
        code, refused, R = self._verdict(st)
        nrows = R if R is not None else self.cfg.max_recv_tokens
        out, q, sc = self._alloc_rows(nrows, keep_quantized)
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
        return self._finish_dispatch(code, refused, st, sync, bad_input, out, out_w, q, sc, handle, store, T, ntpe,
                                     offs, R)

    # ---------------------------------------------------------------------------------------------- combine
    def _combine(self, eo, handle, weighted, gw=None, want_wgrad=False, kind=None, wire=RAW, bad=0, ticket=0):
        """A combine (``weighted``) or the dispatch backward; ``bad``: this rank takes part as refused
        (:meth:`combine_refused`); ``ticket``: the host reads this call's status (:meth:`_after_combine`)."""
        if self.broken:
            self._check_usable()
        g = self.cfg.geometry
        kind = kind or g.combine
        if want_wgrad or wire.quantized:
            kind = "push"  # quantized partials and weight-gradient return are push-only
        if g.decode and kind == "push":  # one launch (also the dispatch backward); it advances CALL_COMBINE itself
            return self._combine_decode(eo, handle, wire, weighted, gw if want_wgrad else None, bad, ticket)
        T, store, k = handle.num_tokens, handle.store, self.k
        y = torch.empty(T, self.cfg.hidden, dtype=eo.dtype, device=self.device)
        what = "combine" if weighted else "dispatch backward"
        if g.fused_combine and kind == "push" and weighted and not want_wgrad:
            k.combine_fused(wire)(eo, store, y, T, bad, ticket)
            self._after_combine(ticket, bad, what)
            return y, None
        k.partial(kind, weighted, want_wgrad, wire)(eo, store, gw if gw is not None else self._no_w, bad)
        gtw = torch.empty(T, self.cfg.topk, dtype=torch.float32, device=self.device) if want_wgrad else None
        k.out(kind, want_wgrad, wire)(store, y, T, _cdiv(T, g.cbt), gtw if gtw is not None else y, ticket)
        self._after_combine(ticket, bad, what)
        return y, gtw

    def _after_combine(self, ticket, bad, what):
        """After a combine's launches: the host's one read of an eager combine (``ticket``: the status its last
        launch published; a peer that refused or never arrived raises here, on every rank), else the strict mode's
        check (none for a refused rank, which raises its own error)."""
        if ticket:
            st = self._read_host_status(ticket)
            if not st[_CODE]:
                return
            st = st[:_ST_ERR]
            if not bad:
                self._raise_words(st, what)
            else:  # a refused rank raises its own error and keeps none of this call's (another rank's
                try:  # refusal in the same call, which that rank's peers raise now); a timeout stays fatal
                    self._raise_words(st, what)
                except PeerTimeoutError:
                    pass
                except TritonEPError:
                    pass
        elif not bad:
            self._eager_check(what)

    def combine_fwd(self, expert_out, handle, kind=None, read=False):
        """Weighted combine ``y [T, H]`` (see the module docstring). ``read``: an eager combine: the host reads the
        call's status once its last launch finished and raises a peer's refusal or timeout (every rank does)."""
        ticket = self.host_status.next_ticket() if read else 0
        if kind is None and self._decode_push and not self.broken:  # what _combine picks, without its branches
            return self._combine_decode(expert_out, handle, self.cwire, ticket=ticket)[0]
        y, _ = self._combine(expert_out, handle, weighted=True, kind=kind, wire=self.cwire, ticket=ticket)
        return y

    def combine_refused(self, kind=None, record_own=True, handle=None):
        """Take part in this call's combine as refused (a refused combine input on this rank, or the caller cancelled
        the combine after a failure of its own): the same launches as the peers' combine with no token and no row,
        which mark the call refused in every peer (their outputs become NaN and their status records it:
        :func:`tritonep.kernels.combine.mark_refused`). ``record_own``: record it in this rank's status too (the
        peers read nothing in this call: sync-free, sync checks off, capture; then the next read raises it on every
        rank, this one included); else the peers' eager read raises it and this rank raises its own error (its own
        read clears what the call recorded here: another rank refused the same call).
        ``handle`` is not needed here (the launches carry no row)."""
        self._combine(self.expert_out_buffer(), self._empty, weighted=True, kind=kind, wire=self.cwire,
                      bad=1 if record_own else 2, ticket=0 if record_own else self.host_status.next_ticket())

    def dispatch_bwd_refused(self, handle=None, with_weights=False):
        """Take part in this call's dispatch backward as refused (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`):
        the peers' launches (the weight-gradient variant with ``with_weights``) with no token and no row, marking the
        call refused in every peer (their outputs NaN, their status records it) and in this rank's status (a
        backward reads nothing on the host: the next read raises it on every rank). ``handle`` is not needed."""
        self._combine(self.expert_out_buffer(), self._empty, weighted=False, gw=self._no_w if with_weights else None,
                      want_wgrad=with_weights, bad=1)

    # ---------------------------------------------------------------------------------------------- backward
    def dispatch_bwd(self, grad_recv_x, grad_recv_w, handle):
        """grad_x[t] = sum_k grad_recv_x[row(t,k)]; grad_topk_weights[t,k] = grad_recv_w[row(t,k)]."""
        gw = grad_recv_w
        return self._combine(grad_recv_x, handle, weighted=False, gw=gw, want_wgrad=gw is not None)

    def combine_bwd(self, grad_y, expert_out, handle):
        """grad_expert_out[row] = w * grad_y[t]; grad_recv_w[row] = <grad_y[t], expert_out[row]>."""
        if self.broken:
            self._check_usable()
        R, H, dev = expert_out.shape[0], self.cfg.hidden, self.device
        # no zero fill: the expand writes every row (routes; alignment padding and rows past the layout's end, read
        # from the handle's segment sizes / offsets on the device, as zeros)
        g_eo = torch.empty(R, H, dtype=self.cfg.dtype, device=dev)
        g_w = torch.empty(R, dtype=torch.float32, device=dev)
        T, store, k = handle.num_tokens, handle.store, self.k
        # grad_y is held until the expand ran: it reads the own rank's rows from it (raw wire)
        k.send_bwd(grad_y, store, T, _cdiv(T, self.cfg.geometry.bt))
        k.expand_bwd(grad_y, g_eo, store, expert_out, g_w, g_w, R)
        self._eager_check("combine backward")
        return g_eo, g_w

    def close(self):
        """Free the symmetric allocation (collective). Later calls raise :class:`BufferStateError`, also those that do
        not pass the EPBuffer's front door (the autograd backward of a call made before the close): its bound kernels
        hold the freed regions' addresses. The output pools let their blocks go."""
        self.broken = "closed" + (f" (unusable before: {self.broken})" if self.broken else "")
        self._pool.clear()  # the output pool's blocks go with the buffer (a caller's kept outputs stay valid)
        if self.buf is not None:
            self.buf.close()
            self.buf = None
            for key in self._shared:  # the shared pools: one user fewer (the last one lets their blocks go)
                release_shared(key, self._shared_slots)  # only what it registered: a buffer of another geometry
                # with the same shape must not take a user away from the decode buffers' pools
            self._dpool = self._ypool = OutputPool(None, 0, self.device)
