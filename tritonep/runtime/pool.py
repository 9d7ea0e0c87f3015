"""Per-call output blocks reused once nobody holds them: a dispatch's allocations and views at the cost of a count.

An eager dispatch of the triton backend allocates its handle storage block (and, on the one-launch decode path, the
``max_recv_tokens`` rows it cuts after the host read) and makes views of the block (``num_tokens_per_expert``,
``expert_offsets``, the row weights): on the H200 host ~15 of the ~47 us of host work of a 128-token decode
dispatch (``benchmarks/probes/launch_probe.py``: ``torch.empty`` 4.2 us, a view 3.0 us). An
:class:`OutputPool` keeps up to ``slots`` such sets per CUDA stream, made once, and hands a set out again when no
one outside the pool holds any of its tensors: the storage use count of every base tensor, the Python reference
count of every tensor object the set hands out and of each base's storage object, and the C++ reference count of
every base tensor are back at their values when the set was made (a caller's view, a handle holding the block, an
autograd node that saved a row, a held ``untyped_storage()``, a DLPack capsule of a base: each raises one of them).

A set whose tensor a caller's in-place op with a differentiable operand put into an autograd graph (its views would
inherit the stale ``grad_fn``), or gave a forward-mode tangent, is dropped, not reused (:meth:`_Set.marked`). A set is
always made of normal tensors, also by a call inside ``torch.inference_mode()`` (a later call in grad mode may get it).

Reuse rules (those of PyTorch's caching allocator, which hands a freed block again only to the next allocation on
the stream it was made on, ordered after every earlier use on that stream):

* a set is reused only on the stream it was made on (at most :data:`MAX_STREAMS` streams get sets; another stream
  allocates as before);
* never while the current stream is capturing a CUDA graph (a capture's outputs come from its private pool: every
  replay writes them) and never while the pool is off (``slots=0``, ``TRITONEP_OUTPUT_POOL=0``);
* when every set of the stream is held, the call allocates as before (a fresh, unpooled set).

The differences to the caching allocator: ``Tensor.record_stream`` does not protect a pooled output (a caller that
uses an output on another stream must keep a reference to it until that stream's work is done), and an output whose
storage is swapped or resized in place (``Tensor.set_``, assigning ``.data``, ``untyped_storage().resize_()``) is
not supported (docs/guarantees.md).

Memory: at most ``slots * MAX_STREAMS`` sets per pool, :attr:`OutputPool.nbytes` bytes once made (the dry run at
construction makes the first set of the construction stream). The large blocks (the decode dispatch's
``max_recv_tokens`` rows, the decode combine's ``[max_tokens_per_rank, H]`` output) live in pools SHARED by every
buffer of the process with the same shape, dtype and device (:func:`acquire_shared`): a model builds one buffer
per MoE layer and runs them one after another, so a per-buffer pool of rows would hold ``layers x slots`` blocks the
caching allocator would have shared; a shared pool holds ``slots`` per stream. On the decode tiles a set holds the
call's handle block AND its rows (the pool's key includes the block's layout), so a call takes one set; the two-kernel
and fused tiles pool only the small handle block (its fields' size), per buffer. So on the decode tiles a
kept handle keeps its set's rows too (a ``keep_quantized`` call's set leaves its rows unused): where every layer's
handle is kept (training: until backward) only ``slots`` calls per stream get pooled sets and the others allocate
both, as without a pool.

Idea: pplx-kernels and DeepEP's low-latency mode hand out receive buffers allocated once per buffer; here the
reuse is decided per call by reference counts, so a caller that keeps an output never sees it overwritten.

Beside the pools, :func:`remember`: the one way a host path keeps a bounded dict of values it makes once per key
(bound launches with their grids, index tensors) and looks up on every call.
"""

from __future__ import annotations

import sys

import torch
from torch.autograd import forward_ad as _fwd

__all__ = ["OutputPool", "MAX_STREAMS", "acquire_shared", "release_shared", "remember"]

MAX_STREAMS = 2  # streams that get sets of their own; calls on more streams allocate as before

_use_count = torch._C._storage_Use_Count
_impl_count = torch.Tensor._use_count  # references to a tensor's C++ object (TensorImpl)
_refcount = sys.getrefcount


_COUNTERS: dict = {}  # (storages, tensors, Python objects) -> the unrolled sum of their counts


def _counter(n_storages: int, n_tensors: int, n_py: int):
    """``f(cdata, objs, py)``: the sum of the storages' use counts, the tensors' C++ counts and the Python objects'
    reference counts, unrolled for a set of this shape (a ``sum(map(...))`` per kind costs ~3x more on every take)."""
    key = (n_storages, n_tensors, n_py)
    f = _COUNTERS.get(key)
    if f is None:
        terms = ([f"_uc(c[{i}])" for i in range(n_storages)] + [f"_ic(o[{i}])" for i in range(n_tensors)]
                 + [f"_rc(p[{i}])" for i in range(n_py)])
        f = _COUNTERS[key] = eval(f"lambda c, o, p: {' + '.join(terms)}",  # noqa: S307 - our own text, ints only
                                  {"_uc": _use_count, "_ic": _impl_count, "_rc": _refcount})
    return f


class _Set:
    """One set of a pool: ``objs`` (the base tensors, then the views made of them; handed out as one tuple) and the
    reference counts that say nobody outside holds any of them."""

    __slots__ = ("objs", "extra", "_keep", "_cdata", "_py", "_base", "_quick", "_q", "nbytes", "_float", "_sum")

    def __init__(self, bases: tuple, views: tuple, extra=None):
        self.objs = tuple(bases) + tuple(views)
        # the tensors that can carry autograd state (:meth:`marked`): an integer tensor never requires grad
        self._float = tuple(t for t in self.objs if t.is_floating_point() or t.is_complex())
        self.extra = extra  # the owner's per-set constant (e.g. a handle's fields): never handed out by the pool
        # keeps each storage's address valid; the Python object is the one ``t.untyped_storage()`` hands a caller
        self._keep = tuple(t.untyped_storage() for t in bases)
        self._cdata = tuple(s._cdata for s in self._keep)
        self._py = self._keep + self.objs + (self.objs,)  # every Python object whose count says "held"
        self._sum = _counter(len(self._cdata), len(self.objs), len(self._py))
        # the quick test's objects: the first base and the first view (the one a caller's result or handle holds
        # most surely: e.g. the row weights); holding a view OBJECT moves no storage use count, only its own
        self._q = (self.objs[0], self.objs[len(bases)] if views else self.objs[0])
        self.nbytes = sum(s.nbytes() for s in self._keep)
        self._base = None  # :meth:`seal`, once the caller's temporaries (``bases``, ``views``) are gone
        self._quick = None

    def seal(self):
        """Record the count of 'nobody outside holds it' (called by the pool right after making the set)."""
        self._base = self._count()
        self._quick = self._quick_count()

    def _quick_count(self) -> int:
        # the counts a held set raises most often (a new view of the first base's storage; the first base or the
        # first view handed out, e.g. held by a handle): a held set is rejected with three reads, not the full count
        q = self._q
        return _use_count(self._cdata[0]) + _refcount(q[0]) + _refcount(q[1])

    def _count(self) -> int:
        # one sum: no count can fall below its value at seal() (the set's own references stay), so the sum equals
        # the sealed one exactly when every count does. Besides the storages' use counts and the tensors' Python
        # counts: the storages' Python objects (a caller's ``t.untyped_storage()`` is the pool's own object: no use
        # count moves) and every tensor's C++ count (a C++ holder of a tensor, e.g. a DLPack capsule or an autograd
        # node that saved it, moves its Python count only while nothing else in C++ holds it: torch keeps a tensor's
        # Python object alive for its C++ holders; a base is already held by the set's own views)
        # (``_py`` holds the storages, the tensors and the tuple itself: a caller may hold it unpacked or not)
        return self._sum(self._cdata, self.objs, self._py)

    def free(self) -> bool:
        """True when no tensor of this set, and no view of its storage, is held outside the pool."""
        return self._quick_count() == self._quick and self._count() == self._base

    def marked(self) -> bool:
        """A tensor of the set carries autograd state: a caller's in-place op with a differentiable operand on a
        view it was handed (``d.x.mul_(w)``, ``w.requires_grad``) made the view's differentiable base part of that
        call's graph (``CopySlices``): a base of the set, or one of its views that changes the dtype (``.view(
        torch.float32)`` of the int32 block is a base of its own for autograd). Its later views would inherit the
        stale ``grad_fn``; such a set is never handed out again (:meth:`OutputPool.take_set` drops it). Likewise a
        forward-mode tangent (``d.x.mul_(dual)`` inside ``torch.autograd.forward_ad.dual_level()``: the base gets a
        tangent, ``requires_grad`` stays False): looked for only while a dual level is open (leaving the level
        discards its tangents), so a take outside forward AD pays one global read for it."""
        for t in self._float:
            if t.requires_grad:
                return True
        if getattr(_fwd, "_current_level", 0) >= 0:  # torch's open dual level (-1: none); unknown: look
            for t in self._float:
                if _fwd.unpack_dual(t).tangent is not None:
                    return True
        return False


class OutputPool:
    """Sets of per-call outputs reused by reference count (see the module docstring).

    Args:
        make: ``make() -> (bases, views)`` or ``(bases, views, extra)``: a new set's base tensors (fresh
            allocations) and the views of them a call hands out, as two tuples (:meth:`take` returns ``bases +
            views``), and optionally the owner's constant of the set (:meth:`take_set`), e.g. a handle's fields.
        slots: sets per stream (0: the pool is off, :meth:`take` returns None).
        device: the buffer's device (CUDA: sets per stream, none under capture).
    """

    def __init__(self, make, slots: int, device: torch.device):
        self._make, self.slots = make, int(slots)
        self._cuda = device.type == "cuda"
        self._dev = device.index if device.index is not None else 0
        self._sets: dict = {}  # stream (raw handle; 0 on CPU) -> [_Set]

    @property
    def nbytes(self) -> int:
        """Bytes of every set made so far (device memory outside the symmetric heap)."""
        return sum(s.nbytes for sets in self._sets.values() for s in sets)

    def base_ptrs(self) -> set:
        """Addresses of every set's base blocks (tests and benchmarks ask whether an output lies in a pooled block)."""
        return {k.data_ptr() for sets in self._sets.values() for s in sets for k in s._keep}

    def clear(self):
        """Let every set go and hand out no more (the buffer's close): a set a caller still holds lives on through
        the caller's references, the others are freed."""
        self._sets.clear()
        self.slots = 0

    def stream_key(self):
        """Where this call's sets live: the current raw CUDA stream (0 on the CPU), or None while the stream is
        capturing a graph (nothing is pooled then). One query serves every pool of the same device in one call
        (:meth:`take`'s ``stream``)."""
        if self._cuda:
            if torch._C._cuda_isCurrentStreamCapturing():
                return None
            return torch._C._cuda_getCurrentRawStream(self._dev)
        return 0

    def take(self, stream=-1):
        """The objects of a set nobody holds (``bases + views`` of ``make``), or None: pool off, graph capture,
        every set of this stream held (``slots`` made), or a stream past :data:`MAX_STREAMS`. The caller then
        allocates as it would without a pool.

        ``stream``: :meth:`stream_key` of this call when the caller already asked it (a pool of the same device),
        else the pool asks."""
        s = self.take_set(stream)
        return None if s is None else s.objs

    def take_set(self, stream=-1):
        """As :meth:`take`, but the set itself (``objs``, ``extra``) or None."""
        if not self.slots:
            return None
        if stream == -1:
            stream = self.stream_key()
        if stream is None:
            return None
        sets = self._sets.get(stream)
        if sets is None:
            if len(self._sets) >= MAX_STREAMS:
                return None
            sets = self._sets[stream] = []
        i = 0
        while i < len(sets):
            s = sets[i]
            if s._quick_count() == s._quick and s._count() == s._base:
                if s.marked():  # autograd state on a tensor of it (_Set.marked): dropped, the scan goes on
                    sets.pop(i)
                    continue
                if i < len(sets) - 1:  # least recently handed out first: a caller that keeps the previous call's
                    sets.append(sets.pop(i))  # outputs while it makes the next call finds the free set at once
                return s
            i += 1
        if len(sets) < self.slots:
            if torch.is_inference_mode_enabled():
                # a set outlives the call that made it: made as normal tensors even inside inference mode, or a
                # later call in grad mode would get inference tensors (no in-place op, not savable for backward)
                with torch.inference_mode(False):
                    s = _Set(*self._make())
            else:
                s = _Set(*self._make())
            s.seal()
            sets.append(s)
            return s
        return None


_SHARED: dict = {}  # key -> [OutputPool, users]


def acquire_shared(key: tuple, make, slots: int, device: torch.device) -> OutputPool:
    """The process-wide pool of ``key`` (made with ``make`` / ``slots`` / ``device`` by its first user), one more
    user counted. ``key`` must decide what ``make`` makes (e.g. ``("rows", device, rows, H, dtype)``) and the slots;
    a pool off (``slots=0``) is never shared. Pair with :func:`release_shared`."""
    if not slots:
        return OutputPool(make, 0, device)
    key = (key, int(slots))
    entry = _SHARED.get(key)
    if entry is None:
        entry = _SHARED[key] = [OutputPool(make, slots, device), 0]
    entry[1] += 1
    return entry[0]


def release_shared(key: tuple, slots: int):
    """One user of :func:`acquire_shared`'s pool fewer; the last one drops the pool (its sets are freed once no
    caller holds their tensors)."""
    if not slots:
        return
    key = (key, int(slots))
    entry = _SHARED.get(key)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _SHARED[key]


def remember(cache: dict, key, value, limit: int):
    """Keep ``value`` as ``key``'s in ``cache`` and return it; a ``cache`` already holding ``limit`` (int >= 1)
    entries is emptied first, so it never holds more (the values dropped are made again on their next miss).

    For a plain dict of values made once per key and read on a hot path: the reader's hit stays ONE dict lookup,
    ``got = cache.get(key)``, and only its miss calls this (``got = remember(cache, key, make(), limit)``).
    Emptying the whole dict, not evicting in order, keeps the miss cheap too; a cache is bounded so that keys that
    follow the data (a token count, a shape) cannot grow it without end."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
