"""The torch.distributed backend of EPBuffer (NCCL on GPU, gloo on CPU): same API and bit-identical results.

For groups whose ranks cannot map each other's memory (several hosts, no P2P). Every step is a small local Triton
kernel (:mod:`tritonep.backends.nccl.route`, :mod:`tritonep.backends.nccl.unpack`, :mod:`tritonep.backends.nccl.pack`; on the CPU
their torch twins, same bits) or a ``torch.distributed`` collective on the current stream. The row layout is the
triton backend's by construction: the same segment formula (:func:`tritonep.backends.layout.layout_torch`, computed on
the host by its numpy twin :func:`host_plan`) and, inside a segment, rows ordered by (source rank, token, k).

A synced dispatch: the counts launch and one ``all_gather`` of the counts rows, THE one host read of the call (the
gathered matrix and the status word), the host plan (refusals and capacity decided here, the same on every rank),
one pack launch into one ``uint8`` send buffer (each token's wire row once per destination rank, then its routing),
one ``all_to_all_single`` with uneven splits, one unpack launch into the expert rows. Combine sends one weighted
fp32-summed partial per (token, rank) back along the reverse splits and sums the partials in rank order: exactly
:func:`tritonep.reference.combine_reference_partial` and the triton backend's bits, for every wire. Combine and
both backward passes read nothing on the host. Graph capture of a synced dispatch is refused (uneven splits need
host sizes); the sync-free dispatch (:mod:`tritonep.backends.nccl.sync_free`) reads nothing and can be captured.

Every launch is a :class:`tritonep.runtime.bound.BoundKernel` bound once with its constants
(:class:`tritonep.runtime.launch.Launch`), and the host path is fixed per call: what the static configuration decides
is made at construction. On the GPU a bf16 dispatch is 3 launches, 2 collectives, 1 device->host copy (into a pinned
buffer: the one read), 1 asynchronous host->device copy of the plan vector, 11 allocations and 17 torch calls; a
combine 2 launches, 1 collective, 3 allocations, 4 torch calls (budgets held by
``tests/backends/nccl/test_host_path_budget.py``). Calls of one buffer run on
one CUDA stream at a time. Timeouts: this backend has no kernel waits; a peer that never arrives is caught by the
process group's own timeout (NCCL watchdog), not by ``timeout_s``.

The protocol step by step (dispatch, combine, backward, copies per call, wires, a hierarchical multi-host design):
docs/protocols.md, "The nccl backend". Idea sources: DeepEP "normal" (host-synchronised) kernels, Megatron-LM's
``MoEAlltoAllTokenDispatcher`` (counts exchange, then uneven token all_to_all); quantize once per token before the
all_to_all as DeepEP's fp8 dispatch does; the fixed per-call host path of vLLM's ``CachedKernel`` / pplx-kernels.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ...errors import BackendError, BufferStateError, CapacityError, InputError, PeerInputError
from ...wire.formats import get_wire
from .handle import NcclHandle
from ..checks import check_expert_ids
from ...runtime.launch import Launch
from .collectives import all_gather_flat, all_to_all_rows
from .combine import NcclCombine
from ...runtime.status import STATUS_COMBINE_REFUSED, count_mismatch_error
from .plan import host_plan, plan_size, status_size
from .route import Router, send_layout
from .sync_free import SyncFreeDispatch
from .unpack import Unpacker

__all__ = ["NcclEP"]


class NcclEP:
    """torch.distributed implementation behind :class:`tritonep.EPBuffer` (same interface as ``TritonEP``): one class
    composed of parts with their own state, the shared route / unpack steps (:class:`tritonep.backends.nccl.route.
    Router`, :class:`tritonep.backends.nccl.unpack.Unpacker`), the combine and backward halves
    (:class:`tritonep.backends.nccl.combine.NcclCombine`) and the sync-free dispatch
    (:class:`tritonep.backends.nccl.sync_free.SyncFreeDispatch`); the synced dispatch and the status read are its own.

    Args: as ``TritonEP``: ``cfg``, the buffer's :class:`tritonep.ep.config.EPConfig` (read whole: any of
    :data:`tritonep.wire.WIRES` for both wires, see the module docstring; ``timeout_s`` only reported: this backend
    has no kernel waits, the process group's own timeout applies), then ``group``, ``rank``, ``device``.

    Attribute ``use_triton`` (default: CUDA device): the local steps run as Triton kernels, else as their torch
    twins (same bits; the twins use ``torch.nonzero`` and are meant for the CPU). ``host_reads`` counts the
    device->host reads of calls (one per synced dispatch, one per :meth:`check`, none per sync-free dispatch; one more
    only when naming this rank's bad expert id).

    Its dispatch returns a frozen :class:`tritonep.backends.nccl.handle.NcclHandle` (split sizes, per-route packets, per-packet
    routes).

    Raises:
        WireError: an unknown wire name or a hidden size the wire cannot take (:func:`tritonep.wire.check_wire`).
    """

    name = "nccl"
    sync_free = True  # dispatch(sync_free=True): fixed per-peer packet slots, no host read (sync_free.py)

    def __init__(self, cfg, *, group, rank, device):
        self.cfg, self.group, self.rank = cfg, group, rank
        self.device = dev = torch.device(device)
        W, E, K, H, L = cfg.world_size, cfg.num_experts, cfg.topk, cfg.hidden, cfg.num_local_experts
        self.host_reads = 0  # device->host reads made by calls: one per dispatch (+1 naming a bad id), else none
        self.use_triton = self._cuda = dev.type == "cuda"
        # local kernels only: none signals or waits for a peer, so none is recorded or capped (their grids follow
        # this rank's data, which the host protocol rule allows for work that signals nobody)
        self._launch = Launch(dev, record=False, max_programs=0, mode=cfg.launch)
        self._es = es = torch.empty(0, dtype=cfg.dtype).element_size()
        # dispatch rows: the wire row (one source, or payload + scale bytes) and the meta
        fmt = self._dfmt = get_wire(cfg.dispatch_wire)
        if fmt.quantized:
            pb, sb = fmt.payload_bytes(H), fmt.scale_bytes(H)
            self._lay = send_layout(pb + sb, K)
            srcs = (1, pb), (1, sb)
        else:
            self._lay = send_layout(H * es, K)
            srcs = (es, H), None
        self._router = Router(W, E, K, cfg.max_tokens_per_rank, dev, self._launch, self._lay, *srcs)
        self._unpacker = Unpacker(rank, E, L, K, H, cfg.expert_alignment, self._launch, self._lay, (E + W, E + W + L),
                                  self._cuda, dev)
        self._kept = (fmt.payload_bytes(H), fmt.num_scales(H)) if fmt.quantized else None
        # the counts exchange: gathered matrix, its host copy, the host plan vector (numpy views made once)
        self._ncols = E + W + 2
        # on a GPU both host buffers are pinned: the one read is a direct DMA, the plan copy truly asynchronous (a
        # pageable copy is staged through a driver buffer). The next call rewrites the plan vector only after its
        # host read synchronised its stream, which covers the previous plan copy when it was made on the same
        # stream (the raw stream is remembered; after a stream change the device is synchronised once)
        # the gathered matrix and the status word (sync-free refusals) share one device block: the synced
        # dispatch's one device->host copy reads both
        ng = W * self._ncols
        # ... and, after them, the refused-combine flags nobody read yet (tritonep.backends.nccl.combine: a
        # sync-free combine ORs every rank's refused flag in, on the device)
        ns = ng + status_size(W)
        self._dev_block = torch.zeros(ns + W, dtype=torch.int32, device=dev)
        self._gathered, self._status, self._cpending = (self._dev_block[:ng], self._dev_block[ng:ns],
                                                        self._dev_block[ns:])
        self._host = torch.empty(ns + W, dtype=torch.int32, pin_memory=self._cuda)
        self._host_np = self._host.numpy()[:ng].reshape(W, self._ncols)
        self._host_st = self._host.numpy()[ng:ns]
        self._host_pend = self._host.numpy()[ns:]
        self._plan_t = torch.zeros(plan_size(W, E), dtype=torch.int32, pin_memory=self._cuda)
        self._plan_np = self._plan_t.numpy()
        self._plan_stream = None  # raw CUDA stream of the last plan copy (0 is the default stream; None: none)
        self._dev_index = dev.index if dev.index is not None else (torch.cuda.current_device() if self._cuda else 0)
        self._split = [E + W, L, L, W * E]
        # shared empties of calls with no tokens / no packets (never written)
        self._no_routes = torch.empty(0, K, dtype=torch.int32, device=dev)
        self._no_w = torch.empty(0, K, dtype=torch.float32, device=dev)
        self._no_send = torch.empty(0, self._lay.width, dtype=torch.uint8, device=dev)
        self._eo: torch.Tensor | None = None
        # the combine half: its refused-combine flags (one gathered per rank per forward combine) merge into the
        # pending flags of the device block above
        self._combine = NcclCombine(cfg, group, dev, self._launch, self._unpacker, pending=self._cpending)
        self._last_handle = None  # weak reference to the latest dispatch's handle (a cancelled combine's splits)
        self._sync_free = SyncFreeDispatch(cfg, group=group, rank=rank, device=dev, launch=self._launch,
                                           router=self._router, unpacker=self._unpacker, gathered=self._gathered,
                                           status=self._status)
        self._buffer_id = 0
        self.closed = False

    @property
    def buffer_id(self) -> int:
        """The owning EPBuffer's id (set by it; handles carry it)."""
        return self._buffer_id

    @buffer_id.setter
    def buffer_id(self, v: int):
        self._buffer_id = self._sync_free.buffer_id = v

    @property
    def sync_free_mode(self) -> str:
        """The sync-free dispatch's mode, ``"onehop"`` or ``"gather"`` (:func:`tritonep.backends.nccl.sync_free.
        sync_free_mode` of the config)."""
        return self._sync_free.mode

    # ---------------------------------------------------------------------------------------------- helpers
    def expert_out_buffer(self) -> torch.Tensor:
        """Persistent ``[max_recv_tokens, H]`` tensor for the expert output (allocated on first use)."""
        if self._eo is None:
            self._eo = torch.zeros(self.cfg.max_recv_tokens, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device)
        return self._eo

    @property
    def allocated_bytes(self) -> int:
        """0: this backend holds no symmetric memory."""
        return 0

    def counts_exchange(self, num_experts: int):
        """A new counts exchange over this backend's group: one ``all_gather``
        (:class:`tritonep.backends.nccl.counts.NcclCountsExchange`; collective)."""
        from .counts import NcclCountsExchange

        cfg = self.cfg
        return NcclCountsExchange(self.group, num_experts, cfg.max_tokens_per_rank, cfg.topk, self.device,
                                  timeout_s=cfg.timeout_s)

    def expert_transport(self, num_experts: int, shapes: dict, dtype: torch.dtype):
        """A new virtual-expert weight transport over this backend's group: ``all_to_all`` per weight
        (:class:`tritonep.backends.nccl.expert_transport.NcclExpertTransport`; collective)."""
        from .expert_transport import NcclExpertTransport

        return NcclExpertTransport(self.group, num_experts, shapes, dtype=dtype, device=self.device,
                                   timeout_s=self.cfg.timeout_s)

    @property
    def tiles(self):
        """None: this backend has no kernel tiles."""
        return None

    @property
    def timeout_s(self) -> float:
        """The config's wait bound, seconds (this backend has no kernel waits: the process group's timeout applies)."""
        return self.cfg.timeout_s

    def close(self):
        """Drop the persistent tensors; later calls raise :class:`BufferStateError`."""
        self._eo = None
        if not self.closed:
            self._sync_free.close()
        self.closed = True

    def _check_open(self):
        if self.closed:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is closed")

    def _plan_to_device(self) -> torch.Tensor:
        """A new device copy of the host plan vector: one host->device copy, never a sync (on a GPU from the pinned
        vector, asynchronously; see :meth:`_plan_writable`)."""
        if self._cuda:
            plan = self._plan_t.to(self.device, non_blocking=True)  # pinned source: asynchronous
            self._plan_stream = torch._C._cuda_getCurrentRawStream(self._dev_index)
            return plan
        return self._plan_t.clone()

    def _plan_writable(self):
        """Make sure the previous call's asynchronous plan copy has read the pinned vector before it is rewritten.

        Called after this call's host read, which synchronised the current stream: nothing more to wait for when
        the previous copy was made on this stream; after a stream change, one device synchronisation (rare)."""
        if torch._C._cuda_getCurrentRawStream(self._dev_index) != self._plan_stream:
            torch.cuda.synchronize(self.device)
        self._plan_stream = None

    # ---------------------------------------------------------------------------------------------- dispatch
    def _raise_bad(self, m, topk_idx: torch.Tensor, bad_input: bool):
        """Raise the input error the counts matrix carries (host int32 ``[W, E + W + 2]``, column ``E + W + 1``: the
        refused flag in bit 0, the count stamp above it; the caller saw one).

        Raises:
            InputError: this rank's own ids are out of range (named by :func:`check_expert_ids`).
            PeerInputError: another rank's input was bad, or this rank's input was refused by the front door
                (``bad_input``); ``bad_ranks`` lists them all.
        """
        E, W = self.cfg.num_experts, self.cfg.world_size
        nbad, refused = m[:, E + W].tolist(), (m[:, E + W + 1] & 1).tolist()  # bit 0: refused; above: count stamp
        bad_ranks = [r for r in range(W) if nbad[r] or refused[r]]
        if nbad[self.rank] and not bad_input:
            self.host_reads += 1
            check_expert_ids(topk_idx, E)  # raises the InputError naming the value and its (token, k)
            raise InputError(f"topk_idx holds {nbad[self.rank]} ids outside [-1, num_experts={E})")
        why = "; ".join(f"rank {r}: " + (f"{nbad[r]} expert ids outside [-1, {E})" if nbad[r]
                                         else "input refused by EPBuffer") for r in bad_ranks)
        raise PeerInputError(f"dispatch on rank {self.rank}: invalid input on rank(s) {bad_ranks} ({why}); no rows "
                             "moved on any rank, the buffer stays usable", bad_ranks=bad_ranks, rank=self.rank)

    def dispatch_fwd(self, x, topk_idx, topk_weights, sync: int, keep_quantized: bool = False,
                     bad_input: bool = False, sync_free: bool = False, count=None):
        """See :meth:`tritonep.EPBuffer.dispatch` (``x`` etc. have passed the front door's shape / dtype checks).

        Args:
            x: ``[T, H]`` bfloat16 contiguous; topk_idx: ``[T, K]`` int32 / int64 contiguous; topk_weights:
                ``[T, K]`` float32 contiguous.
            sync: the call's ``TRITONEP_SYNC_CHECKS`` mode; ignored (the one host read of the split sizes is needed
                whatever it says). keep_quantized: see below.
            bad_input: the front door refused this rank's input and passes empty tensors (``[0, H]``, ``[0, K]``,
                ``[0, K]``): the rank still joins the counts exchange with its error flag set, so every rank
                raises and no rows move.
            sync_free: ``dispatch(sync_free=True)`` (:class:`tritonep.backends.nccl.sync_free.SyncFreeDispatch`: no
                host read, ``max_recv_tokens`` rows, errors raised by the next :meth:`check` / synced dispatch).
            count: None or ``(count_ids, count_experts, Tc, CK)`` (:meth:`tritonep.EPBuffer.dispatch`): this backend
                sums no count routing (``handle.count_sums`` None), but a synced call checks that the ranks agree:
                its stamp (``count_experts``, 0 without) rides in its counts row above the refused flag, and ranks
                that disagree raise CountRoutingError on every rank before any row moves. A sync-free call does not
                check it (it has no sums to spoil; its device plan reads the refused flag only).

        Returns ``(out [R, H], out_w [R] f32, num_tokens_per_expert [L] i32, expert_offsets [L] i32, handle)``;
        with ``keep_quantized`` and an fp8 / mxfp4 dispatch wire ``out`` is the payload (uint8 ``[R, H]`` /
        ``[R, H/2]``) and the scales are in ``handle.x_scales`` (fp32 ``[R, H/128]`` / uint8
        ``[R, H/32]``), as on the triton backend.

        Raises:
            BackendError: CUDA-graph capture of a synced dispatch (host split sizes are needed).
            InputError: this rank's expert ids are outside ``[-1, E)`` (names the first value and its (token, k));
                raised after the counts exchange, nothing moved on any rank.
            PeerInputError: another rank's input was invalid (or ``bad_input``); nothing moved on any rank.
            CountRoutingError: the ranks passed different count routings (``count``); nothing moved on any rank.
            CapacityError: some rank would receive more than ``max_recv_tokens`` rows (raised on every rank,
                nothing sent).
            Synced only, also: the refusal of an earlier sync-free dispatch nobody read (its InputError /
                PeerInputError / CapacityError, on every rank; this call moves nothing).
        """
        if self.closed:
            self._check_open()
        if sync_free:
            res = self._sync_free.dispatch(x, topk_idx, topk_weights, keep_quantized, bad_input, self.use_triton)
            self._last_handle = weakref.ref(res[4])
            return res
        dev = self.device
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise BackendError("the nccl backend's synced dispatch cannot be captured in a CUDA graph: all_to_all "
                               "needs host split sizes; use dispatch(..., sync_free=True) or backend='triton'")
        # TRITONEP_SYNC_CHECKS=0 (sync False) cannot remove the split-size read all_to_all needs: the one host
        # read happens whatever the setting
        W, E, K, H, ut, lay, fmt = self.cfg.world_size, self.cfg.num_experts, self.cfg.topk, self.cfg.hidden, self.use_triton, self._lay, self._dfmt
        T = x.shape[0]
        # 1) counts exchange: the one host read
        # the refused flag (bit 0) with this call's count stamp above it (count_experts, 0 without count_ids): the
        # ranks must pass the same count routing, checked with the counts row every rank gathers anyway
        flags = int(bad_input) | ((count[1] if count is not None else 0) << 1)
        row = self._router.count(topk_idx, T, flags, ut)
        all_gather_flat(self._gathered, row, self.group)
        self._host.copy_(self._dev_block)
        self.host_reads += 1
        m = self._host_np
        # 2) host decisions on the small matrix (numpy: a few microseconds, no device work); first a refusal of an
        # earlier sync-free dispatch nobody read (the status word came with the matrix): nothing moves
        if self._host_st[0]:
            self._status.zero_()
            if self._host_pend.any():  # a combine refused behind it (the same failed step): one read clears both
                self._cpending.zero_()
            self._sync_free.raise_status(self._host_st.tolist(), "dispatch")
        if self._host_pend.any():  # a sync-free combine some rank refused, nobody read yet: nothing moves
            self._raise_pending(self._host_pend.tolist(), "dispatch")
        fl = m[:, E + W + 1]  # per rank: refused by the front door (bit 0) | count stamp << 1 (count_experts or 0)
        if m[:, E + W].any() or fl.any():  # bad ids, a refused input, or a count routing somewhere
            if m[:, E + W].any() or (fl & 1).any():
                self._raise_bad(m, topk_idx, bad_input)
            if (fl != fl[0]).any():  # the ranks' count routings differ: refused on every rank, nothing moved
                stamps = (fl >> 1).tolist()
                odd = next(r for r in range(W) if stamps[r] != stamps[0])  # named as the triton backend names it
                raise count_mismatch_error(f"dispatch on rank {self.rank}", self.rank, {0: stamps[0], odd: stamps[odd]},
                                           [r for r in range(W) if stamps[r]], "no rows moved on any rank, the "
                                           "buffer stays usable")
        if self._plan_stream is not None:
            self._plan_writable()
        need, send_splits, recv_splits = host_plan(m, self.rank, W, E, self.cfg.expert_alignment, self._plan_np)
        if need.max() > self.cfg.max_recv_tokens:
            worst = int(need.argmax())
            raise CapacityError(f"dispatch: rank {worst} would receive {int(need[worst])} rows but "
                                f"max_recv_tokens={self.cfg.max_recv_tokens}; nothing was sent",
                                needed=int(need[worst]), available=self.cfg.max_recv_tokens)
        R = int(need[self.rank])
        Ns, Nr = sum(send_splits), sum(recv_splits)
        plan = self._plan_to_device()
        _, ntpe, offs, counts = torch.split(plan, self._split)
        # 3) pack: rows, packet slots and the send rows in one pass
        if T:
            rows = torch.empty(T, K, dtype=torch.int32, device=dev)
            pkt = torch.empty(T, K, dtype=torch.int32, device=dev)
            send = torch.empty(Ns, lay.width, dtype=torch.uint8, device=dev)
            # the handle owns the routing it reads again (the dispatch backward's weight-gradient gather): a copy,
            # written by the pack launch, so a caller that refills its routing tensors in place after dispatch
            # changes nothing
            idx_c, w_c = torch.empty_like(topk_idx), torch.empty_like(topk_weights)
            src0, src1 = fmt.quantize_bytes(x) if fmt.quantized else (x, None)  # quantized once per token
            self._router.pack(src0, src1, topk_idx, topk_weights, plan, send, rows, pkt, T, ut, idx_c, w_c)
        else:
            rows = pkt = self._no_routes
            send = self._no_send
            idx_c, w_c = topk_idx.new_empty(0, K), self._no_w
        kq = keep_quantized and fmt.quantized
        zero_row = kq and self.cfg.expert_alignment > 1  # kept padding rows copy the encoding of a zero row (row Nr)
        recv = torch.empty(Nr + zero_row, lay.width, dtype=torch.uint8, device=dev)
        if zero_row:
            recv[Nr].zero_()
            fmt.wire_views(recv[Nr:], H)[1].fill_(fmt.zero_scale)
        all_to_all_rows(recv[:Nr] if zero_row else recv, send, send_splits, recv_splits, self.group)
        # 4) unpack: every packet's row to the rows of its routes here
        if Nr:
            rr = torch.empty(Nr, K, dtype=torch.int32, device=dev)
            rw = torch.empty(Nr, K, dtype=torch.float32, device=dev)
        else:
            rr, rw = self._no_routes, self._no_w
        out_w = torch.empty(R, dtype=torch.float32, device=dev)
        sc = None
        if not fmt.quantized:
            out = torch.empty(R, H, dtype=self.cfg.dtype, device=dev)
            srcs, widths = [(recv, 0, lay.width // self._es)], (H,)
        elif kq:
            pb, ns = self._kept
            out = torch.empty(R, pb, dtype=torch.uint8, device=dev)
            sc = torch.empty(R, ns, dtype=fmt.scale_dtype, device=dev)
            se = fmt.codec.scale_bytes
            srcs, widths = [(recv, 0, lay.width), (recv, pb // se, lay.width // se)], (pb, ns)
        else:  # one dequantization per received packet, then the scatter
            out = torch.empty(R, H, dtype=self.cfg.dtype, device=dev)
            srcs, widths = ([(fmt.dequantize_rows(recv, H, self.cfg.dtype), 0, H)] if R else []), (H,)
        if R:
            self._unpacker.unpack(recv, srcs, [out] if sc is None else [out, sc], widths, out_w, rr, rw, plan, Nr,
                                  zero_row, ut, R=R)
        handle = NcclHandle._new(topk_idx=idx_c, topk_weights=w_c, rows=rows,
                                 counts=counts.view(W, E), num_tokens=T, num_recv_rows=R, x_scales=sc,
                                 recv_weights=out_w, buffer_id=self._buffer_id, send_splits=send_splits,
                                 recv_splits=recv_splits, num_send=Ns, num_recv=Nr, pkt=pkt, recv_rows=rr,
                                 recv_w=rw)
        self._last_handle = weakref.ref(handle)
        return out, out_w, ntpe, offs, handle

    # ---------------------------------------------------------------------------------------------- combine
    def combine_fwd(self, expert_out, handle, kind=None, read=False):
        """``y [T, H]`` over the combine wire (``kind`` is ignored: there is one combine on this backend).

        Args:
            expert_out: ``[R', H]`` bfloat16 contiguous, ``R' >= R``; handle: the dispatch's handle.
            read: an eager combine: the host reads every rank's refused flag of this call and raises PeerInputError
                naming the refused ranks (:meth:`_combine_flags`).
        """
        if self.closed:
            self._check_open()
        y = self._combine.combine(expert_out, handle, True, self.use_triton, wire=self.cfg.combine_wire)[0]
        self._combine_flags(y, False, read, True)
        return y

    def defer_refusal(self, error):
        """See :meth:`tritonep.backends.interface.EPBackend.defer_refusal` (the sync-free status word's read,
        :meth:`tritonep.backends.nccl.sync_free.SyncFreeDispatch.raise_status`)."""
        self._sync_free.deferred = error

    def combine_refused(self, kind=None, record_own=True, handle=None):
        """Take part in this call's combine as refused (:meth:`tritonep.EPBuffer.cancel_combine`): the same
        collectives as the peers' combine, NaN partial rows, the refused flag set. ``handle``: the call's handle on
        this rank, or None (the latest dispatch's: the split sizes must be the peers'). ``record_own``: as
        ``TritonEP.combine_refused`` (False: the peers read this call's flags and raise; this rank keeps nothing).

        Raises:
            BackendError: no handle passed and no dispatch handle of this buffer is alive.
        """
        if self.closed:
            self._check_open()
        handle = self._handle_to_cancel(handle, "combine")
        y = self._combine.combine(self.expert_out_buffer(), handle, True, self.use_triton,
                                  wire=self.cfg.combine_wire, bad=True)[0]
        self._combine_flags(y, True, False, record_own)

    def _handle_to_cancel(self, handle, what: str):
        """``handle``, or the latest live dispatch handle of this buffer when None: a cancelled call needs the
        dispatch's split sizes to run the peers' collectives.

        Raises:
            BackendError: none passed and none alive (no peer can be in that call either)."""
        if handle is None and self._last_handle is not None:
            handle = self._last_handle()
        if handle is None:
            raise BackendError(f"rank {self.rank}: no dispatch handle to cancel the {what} of (the nccl backend needs "
                               f"the dispatch's split sizes to take part); pass the handle")
        return handle

    def _combine_flags(self, y, bad: bool, read: bool, record_own: bool):
        """Every rank's refused flag of this forward combine (one ``all_gather`` of an int32, every rank:
        :meth:`tritonep.backends.nccl.combine.NcclCombine.refusals`). ``read`` (an eager combine): the host reads them
        and raises PeerInputError naming the refused ranks (a refused rank raises its own error instead); else the
        output is NaN when any rank refused and the refusal is kept in the pending flags on the device
        (``record_own`` False: a refused rank whose peers raise in this call does not keep it either)."""
        flags = self._combine.refusals(y, bad, read, record_own)
        if flags is not None:
            self.host_reads += 1
            if any(flags) and not bad:
                self._raise_pending(flags, "combine")

    def _raise_pending(self, flags: list, what: str):
        """Raise (once: the flags are cleared) the refused combine the pending flags ``flags`` (host, ``[W]``)
        record: PeerInputError naming the ranks that took part as refused
        (:meth:`tritonep.backends.nccl.sync_free.SyncFreeDispatch.raise_status` of a STATUS_COMBINE_REFUSED word)."""
        self._cpending.zero_()
        W = self.cfg.world_size
        refused = [r for r in range(W) if flags[r]]
        self._sync_free.raise_status(
            [STATUS_COMBINE_REFUSED, refused[0], 1, 0] + [0] * W + [1 if f else 0 for f in flags], what)

    def dispatch_bwd(self, grad_recv_x, grad_recv_w, handle):
        """grad_x[t] = sum_k grad_recv_x[row(t,k)]; grad_topk_weights[t,k] = grad_recv_w[row(t,k)] (bf16 wire).

        Args:
            grad_recv_x: ``[R, H]`` bfloat16; grad_recv_w: float32 ``[R]`` or None.

        Returns:
            ``(grad_x [T, H] bfloat16, grad_topk_weights float32 [T, K] or None)``.
        """
        if self.closed:
            self._check_open()
        out = self._combine.combine(grad_recv_x.contiguous(), handle, False, self.use_triton,
                                    gw=grad_recv_w.contiguous() if grad_recv_w is not None else None)
        self._combine.refusals(None, False, False, True)  # a peer's refusal kept for the next read
        return out

    def dispatch_bwd_refused(self, handle=None, with_weights=False):
        """Take part in this call's dispatch backward as refused (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`):
        the peers' collectives with NaN rows and the refused flag set (every element of their outputs computed from
        this rank's rows is NaN, the refusal is kept for the next read on every rank, this one included).
        ``handle``: the dispatch's handle on this rank, or None (the latest dispatch's: the split sizes must be the
        peers'); ``with_weights``: the peers pass ``grad_recv_w`` (the same row layout as theirs).

        Raises:
            BackendError: no handle passed and no dispatch handle of this buffer is alive.
        """
        if self.closed:
            self._check_open()
        handle = self._handle_to_cancel(handle, "dispatch backward")
        self._combine.combine(self.expert_out_buffer(), handle, False, self.use_triton,
                              gw=self._no_w if with_weights else None, bad=True)
        self._combine.refusals(None, True, False, True)

    def combine_bwd(self, grad_y, expert_out, handle):
        """grad_expert_out[row] = bf16(w * grad_y[t]); grad_recv_w[row] = <grad_y[t], expert_out[row]> (fp32);
        see :meth:`tritonep.backends.nccl.combine.NcclCombine.combine_bwd`. A peer that took part as refused
        (:meth:`combine_bwd_refused`) makes every row computed from its rows NaN and is kept for the next read."""
        if self.closed:
            self._check_open()
        out = self._combine.combine_bwd(grad_y, expert_out, handle, self.use_triton)
        self._combine.refusals(None, False, False, True)  # a peer's refusal kept for the next read
        return out

    def combine_bwd_refused(self, handle=None):
        """Take part in this call's combine backward as refused (:meth:`tritonep.EPBuffer.cancel_combine_backward`):
        the peers' collective with NaN rows and the refused flag set (every row of their outputs computed from this
        rank's rows is NaN, the refusal is kept for the next read on every rank, this one included). ``handle``: the
        dispatch's handle on this rank, or None (the latest dispatch's: the split sizes must be the peers').

        Raises:
            BackendError: no handle passed and no dispatch handle of this buffer is alive.
        """
        if self.closed:
            self._check_open()
        handle = self._handle_to_cancel(handle, "combine backward")
        self._combine.combine_bwd(None, None, handle, self.use_triton, bad=True)
        self._combine.refusals(None, True, False, True)

    # ---------------------------------------------------------------------------------------------- status
    def check(self, what="EPBuffer"):
        """Read the status word and the pending refused-combine flags (one host read) and raise the refusal of an
        earlier sync-free dispatch nobody read yet, else that of a sync-free combine some rank refused (reported
        once: the read clears both, the dispatch's error standing for a combine refused behind it; the buffer stays
        usable; see :meth:`tritonep.backends.nccl.sync_free.SyncFreeDispatch.raise_status`).

        Raises:
            InputError / PeerInputError / CapacityError: a sync-free dispatch's refusal.
            PeerInputError: some rank took part in a sync-free combine as refused (when the word holds no error).
        """
        self.host_reads += 1
        words = self._dev_block[self._gathered.numel():].tolist()  # the status word and the pending flags: one read
        n = self._status.numel()
        st, pend = words[:n], words[n:]
        if st[0]:
            self._status.zero_()
            if any(pend):  # a combine refused behind it (the same failed step): one read reports and clears both,
                self._cpending.zero_()  # as the triton backend's word keeps the first error of those piled up
            self._sync_free.raise_status(st, what)
        if any(pend):  # a sync-free combine some rank refused (tritonep.backends.nccl.combine)
            self._raise_pending(pend, what)
