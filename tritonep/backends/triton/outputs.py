"""Host-side pieces of a forward dispatch of the triton backend: the handle storage layout and the outputs.

* :class:`HandleLayout`: the static layout of one call's handle storage (row weights, routing copy, rows, receiver
  metadata, segment sizes and offsets, counts snapshot): ONE int32 allocation per dispatch whose fields are
  :class:`tritonep.runtime.field_view.FieldView` s (an address and a dtype; the tensor view is built only when Triton's
  own launch path or a reader needs it: no ``split_with_sizes`` per call, ~17 us of GPU-host time before), every
  field 256-byte aligned so the kernels' 16-byte pointer specialisation never changes between calls.
* :class:`DispatchOutputs` (a part of :class:`tritonep.backends.triton.backend.TritonEP`): the buffer's handle layout
  and every output pool it takes sets from (:mod:`tritonep.runtime.pool`), a dispatch's rows, and the handle filled at
  the end. The staged tiles (two-kernel / fused) pool the handle storage per buffer; the decode tiles take the handle
  storage AND the ``max_recv_tokens`` rows as one set of a pool shared by every buffer of the same shape, and the
  combine's ``[max_tokens_per_rank, H]`` output from another (one buffer per MoE layer, run one after another).
"""

from __future__ import annotations

import torch

from ...runtime.field_view import FieldView
from ...runtime.pool import OutputPool, acquire_shared, release_shared
from .handle import TritonHandle

__all__ = ["DispatchOutputs", "HandleLayout"]

_new_handle = object.__new__  # an instance of a (frozen) dataclass without its generated ``__init__``

_ALIGN = 64  # int32 elements: every field starts on a 256-byte boundary


class HandleLayout:
    """Where each field of a call's handle storage lives (static per buffer; see the module docstring).

    Fields (flat, in this order, each starting on a 256-byte boundary): ``rw`` ``[max_recv_tokens]`` float32 (the
    row weights a dispatch returns, its first R elements: one allocation fewer per call, made before the launch; a
    sync-free call off the decode path, two-kernel or fused, allocates its zeroed weights apart), ``idx`` ``[Tmax*K]`` (the handle's int32 copy of
    ``topk_idx``), ``w`` ``[Tmax*K]`` float32 (copy of ``topk_weights``), ``rows`` ``[Tmax*K]``, ``meta``
    ``[W*Tmax*K]``, ``wts`` ``[W*Tmax*K]`` float32, ``ntok`` ``[W]``, ``ntpe`` ``[L]``, ``offs`` ``[L]``,
    ``counts`` ``[W*E]``. ``rw`` is first so the weights view starts at storage offset 0, contiguous: the
    metadata of a fresh tensor, what the fake of ``tritonep::dispatch`` (:mod:`tritonep.ep.ops`) gives.
    """

    FLOAT = frozenset(("w", "wts", "rw"))

    def __init__(self, cfg):
        W, E, Tm, K = cfg.world_size, cfg.num_experts, cfg.max_tokens_per_rank, cfg.topk
        L = cfg.num_local_experts
        self.sizes_real = dict(rw=cfg.max_recv_tokens, idx=Tm * K, w=Tm * K, rows=Tm * K, meta=W * Tm * K,
                               wts=W * Tm * K, ntok=W, ntpe=L, offs=L, counts=W * E)
        self.names = tuple(self.sizes_real)
        self.index = {n: i for i, n in enumerate(self.names)}  # the field of name n is views[index[n]]
        self.fields, start = [], 0
        for n in self.names:
            size = self.sizes_real[n]
            self.fields.append((start, size, torch.float32 if n in self.FLOAT else torch.int32))
            start = -(-(start + size) // _ALIGN) * _ALIGN  # a padding gap after it: the next starts on 256 bytes
        self.numel = start
        self.K, self.W, self.E, self.Tm = K, W, E, Tm

    def new(self, device) -> torch.Tensor:
        """A new call's storage block: one allocation, no view (kernels bound with :meth:`fields` take the block
        itself, :data:`tritonep.runtime.bound.STORE`; a handle makes its :meth:`views` when someone reads a field)."""
        return torch.empty(self.numel, dtype=torch.int32, device=device)

    def views(self, store: torch.Tensor) -> tuple:
        """The fields of ``store`` as a tuple of :class:`FieldView` (no tensor op), in :attr:`names` order."""
        base = store.data_ptr()
        return tuple([FieldView(store, base, s, n, dt) for s, n, dt in self.fields])

    def field_view(self, store: torch.Tensor, name: str) -> FieldView:
        """Field ``name`` of ``store`` as one :class:`FieldView` (an address and a dtype, no tensor op): a launch
        argument, e.g. the row weights the data kernels write."""
        s, n, dt = self.fields[self.index[name]]
        return FieldView(store, store.data_ptr(), s, n, dt)

    def fields_of(self, **params) -> dict:
        """``{kernel parameter: (start, numel, dtype)}`` for ``parameter=field_name`` pairs: the ``fields`` of a
        :class:`tritonep.runtime.bound.BoundKernel` whose per-call storage block is this layout's."""
        return {p: self.fields[self.index[n]] for p, n in params.items()}

    def tensor(self, store: torch.Tensor, name: str, n: int | None = None) -> torch.Tensor:
        """Field ``name`` of ``store`` (its first ``n`` elements; all by default) as a 1-D tensor view (one slice,
        plus a reinterpreting view for float fields): what a dispatch returns for ``num_tokens_per_expert`` /
        ``expert_offsets`` / the row weights."""
        s, size, dt = self.fields[self.index[name]]
        t = store[s:s + (size if n is None else n)]
        return t if dt is torch.int32 else t.view(dt)

    def shaped(self, views: tuple, name: str, num_tokens: int) -> torch.Tensor:
        """Field ``name`` of a call's views with its logical shape (``[T, K]`` for the per-token fields)."""
        v = views[self.index[name]].tensor()
        K, W, Tm = self.K, self.W, self.Tm
        if name in ("idx", "w", "rows"):
            return v[:num_tokens * K].view(num_tokens, K)
        if name in ("meta", "wts"):
            return v[:W * Tm * K].view(W, Tm, K)
        if name == "counts":
            return v[:W * self.E].view(W, self.E)
        return v


class DispatchOutputs:
    """What a forward dispatch allocates or takes from the buffer's output pools, and where a decode combine's output
    comes from (a part of :class:`tritonep.backends.triton.backend.TritonEP` with its own state: the handle layout, the
    pools, the empty rows of a kept-quantized call; see the module docstring).

    Args:
        cfg: the buffer's config (sizes, ``hidden``, ``dtype``; ``output_pool``: sets per stream, 0: every call
            allocates; ``tiles.decode``: which pools). dfmt: the dispatch wire's
            :class:`tritonep.wire.formats.WireFormat`. device: the rank's device.

    Attributes:
        hl: the :class:`HandleLayout` of every call's handle storage.
        pool: the staged tiles' handle storage sets (this buffer's; off on the decode tiles).
        decode_pool: the decode tiles' shared sets ``(store, rows, row weights, ntpe, offs)`` (off elsewhere).
        ypool: the decode tiles' shared ``[max_tokens_per_rank, H]`` combine outputs (off elsewhere).
    """

    def __init__(self, cfg, dfmt, device: torch.device):
        self.cfg, self.dfmt, self.device = cfg, dfmt, device
        self.hl = hl = HandleLayout(cfg)
        self.buffer_id = 0  # the owning EPBuffer's id (handles carry it)
        self._no_rows = torch.empty(0, cfg.hidden, dtype=cfg.dtype, device=device)
        # the decode tiles' pools are shared by the buffers of one shape (keyed by it): ``_shared_slots`` is what this
        # buffer registered with them (0: none; a buffer of other tiles with the same shape must not take a user
        # away from them at its close)
        slots, dec = cfg.output_pool, bool(cfg.tiles.decode)
        self._shared_slots = slots if dec else 0
        H, dt, rows, Tm = cfg.hidden, cfg.dtype, cfg.max_recv_tokens, cfg.max_tokens_per_rank
        self._keys = (("dec", str(device), rows, H, dt, hl.numel, tuple(hl.fields)), ("y", str(device), Tm, H, dt))
        make_dec, make_y = _decode_set_maker(hl, rows, H, dt, device), _y_maker(Tm, H, dt, device)
        self.pool = OutputPool(self._make_set, 0 if dec else slots, device)
        self.decode_pool = acquire_shared(self._keys[0], make_dec, self._shared_slots, device)
        self.ypool = acquire_shared(self._keys[1], make_y, self._shared_slots, device)
        self._carry_pools: dict = {}  # (CK, ids dtype) -> this buffer's pool of carried outputs (decode tiles)

    def pools(self) -> tuple:
        """The pools this buffer takes sets from (the shared ones only on the decode tiles)."""
        return (self.pool,) + ((self.decode_pool, self.ypool) if self._shared_slots else ()) + tuple(
            self._carry_pools.values())

    def close(self):
        """Let the pools go (the buffer's close; a caller's kept outputs stay valid): this buffer's sets, and one
        user fewer of the shared pools (the last one lets their blocks go), once."""
        self.pool.clear()
        for p in self._carry_pools.values():
            p.clear()
        for key in self._keys:
            release_shared(key, self._shared_slots)
        self._shared_slots = 0
        self.decode_pool = self.ypool = OutputPool(None, 0, self.device)

    def _make_set(self):
        """A new set of the pool: ``(store,), (ntpe, offs, row weights)`` (all fields whole)."""
        hl = self.hl
        store = hl.new(self.device)
        return (store,), (hl.tensor(store, "ntpe"), hl.tensor(store, "offs"), hl.tensor(store, "rw"))

    def carried(self, ck: int, id_dtype: torch.dtype) -> tuple:
        """``(idx [max_recv_tokens, ck] of id_dtype, weights [max_recv_tokens, ck] float32)``: the outputs a dispatch
        carrying its count routing with the rows writes (uncleared: its launch writes every row), a set of this
        buffer's pool of them (one per ``(ck, id_dtype)``, made on first use; reused once nobody holds them, as the
        rows: :mod:`tritonep.runtime.pool`), or fresh (graph capture, every set held, the pool off). Two
        ``torch.empty`` on a GPU host cost ~8 us; a pooled take ~2 us."""
        key = (ck, id_dtype)
        pool = self._carry_pools.get(key)
        if pool is None:
            pool = self._carry_pools[key] = OutputPool(_carry_maker(self.cfg.max_recv_tokens, ck, id_dtype,
                                                                    self.device), self._shared_slots, self.device)
        got = pool.take()
        if got is not None:
            return got
        return _carry_maker(self.cfg.max_recv_tokens, ck, id_dtype, self.device)()[0]

    def take(self):
        """This call's handle storage: ``(store, ntpe, offs, row weights)`` from the pool, or ``(store, None, None,
        None)`` freshly allocated (graph capture, every set held, the pool off)."""
        got = self.pool.take()
        if got is not None:
            return got
        return self.hl.new(self.device), None, None, None

    def alloc_rows(self, nrows, keep_quantized):
        """``(out, q, sc)`` for ``nrows`` received rows (rows are not cleared: with sync checks off they are
        unspecified); the row weights live in the handle storage (field ``rw``) or, sync-free on the two-kernel
        path, in a zeroed tensor of their own."""
        if keep_quantized and self.dfmt.quantized:
            # not cleared either: the expand writes the encoding of a zero row into the padding rows (fp8 scale
            # 2^-126, e8m0 0), as the twins give (a memset of the whole payload cost a pass over its bytes)
            H = self.cfg.hidden
            q = torch.empty(nrows, self.dfmt.payload_bytes(H), dtype=torch.uint8, device=self.device)
            sc = torch.empty(nrows, self.dfmt.num_scales(H), dtype=self.dfmt.scale_dtype, device=self.device)
            return self._no_rows, q, sc
        return torch.empty(nrows, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device), None, None

    @staticmethod
    def new_handle():
        """This call's handle, still empty: :meth:`finish` fills every field at once (the backend makes it while its
        launch runs; it reaches no caller before)."""
        return _new_handle(TritonHandle)

    def finish(self, handle, store, T, R, out, out_w, q, sc, ntpe, offs, count_sums=None, carried=None):
        """The forward dispatch's return tuple ``(rows, row_weights, num_tokens_per_expert, expert_offsets,
        handle)``, ``handle`` (from :meth:`new_handle`) filled here: the call's storage block ``store``, ``T``
        tokens, ``R`` rows received; ``ntpe`` / ``offs``: the two views of its storage the call returns;
        ``count_sums``: the count routing's sums (the decode dispatch), else None; ``carried``: the count routing
        carried with the rows (``(idx, weights)``, the decode dispatch), else None."""
        handle._fill(store, self.hl, T, self.buffer_id, R, out_w, sc, count_sums, carried)
        return (out if q is None else q), out_w, ntpe, offs, handle


def _carry_maker(rows: int, ck: int, id_dtype: torch.dtype, device: torch.device):
    """``make()`` of a pool of carried outputs: ``(idx [rows, ck] id_dtype, weights [rows, ck] float32), ()``."""
    def make():
        return (torch.empty(rows, ck, dtype=id_dtype, device=device),
                torch.empty(rows, ck, dtype=torch.float32, device=device)), ()
    return make


def _decode_set_maker(hl: HandleLayout, rows: int, H: int, dtype: torch.dtype, device: torch.device):
    """``make()`` of the decode tiles' shared pool: ``(store, rows), (row weights, ntpe, offs)``, the handle block of
    layout ``hl`` and the ``[rows, H]`` rows; the row weights first among the views (the pool's quick test reads them:
    a caller's kept weights or handle hold them). It holds no buffer: the pool outlives the buffer that made it while
    another buffer of the shape uses it."""
    def make():
        store = hl.new(device)
        return ((store, torch.empty(rows, H, dtype=dtype, device=device)),
                (hl.tensor(store, "rw"), hl.tensor(store, "ntpe"), hl.tensor(store, "offs")))
    return make


def _y_maker(Tm: int, H: int, dtype: torch.dtype, device: torch.device):
    """``make()`` of the decode combine's shared pool: one ``[Tm, H]`` output block, no view."""
    return lambda: ((torch.empty(Tm, H, dtype=dtype, device=device),), ())
