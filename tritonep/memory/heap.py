"""Symmetric heaps: the same allocation sequence on every rank gives regions every peer can address.

Two implementations behind one interface (:class:`SymmetricHeap` -> :class:`SymmetricBuffer`):

* :class:`CudaHeap`: ``torch.distributed._symmetric_memory`` (``symm_mem.empty`` + ``rendezvous``), one allocation
  per buffer; int64 device pointer tables (one entry per rank) per region.
* :class:`CpuHeap`: one fork-shared anonymous ``mmap`` made by the parent *before* forking the ranks
  (docs/platform.md). Rank r owns the slice ``[r * slice_bytes, (r + 1) * slice_bytes)``; every process sees the whole
  mapping at the same address, so the pointer tables are plain host addresses that the Triton interpreter
  dereferences. Allocations are first-fit over the free extents of the slice (freed space is reused wherever it
  lies, neighbouring free extents coalesce): the same sequence of allocations and frees on every rank gives the
  same offsets (checked with one small collective per allocation).

Construction of a buffer zeroes this rank's copy and then barriers across the group, so no peer can write into a
buffer that is still being zeroed (the seeds record a first-call hang from exactly that race).
"""

from __future__ import annotations

import mmap
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import BufferStateError, ConfigError, HeapError, LayoutError
from .collectives import group_barrier
from .layout import Layout, Region, layout

__all__ = ["SymmetricBuffer", "SymmetricHeap", "CpuHeap", "CudaHeap", "install_cpu_heap", "installed_cpu_heap",
           "get_heap"]


class SymmetricBuffer:
    """A set of named regions allocated symmetrically on every rank of a group.

    Use :meth:`local` for this rank's tensor of a region, :meth:`peer` for another rank's (a view into its memory)
    and :meth:`ptr_table` for the int64 tensor ``[world_size]`` of every rank's base address of a region, which
    Triton kernels cast with ``tl.load(table + r).to(tl.pointer_type(T))``.
    """

    def __init__(self, heap: "SymmetricHeap", lay: Layout, base_ptrs: Sequence[int], local_bytes: torch.Tensor):
        self.heap = heap
        self.layout = lay
        self.base_ptrs = [int(p) for p in base_ptrs]
        self._bytes = local_bytes  # uint8 [layout.total] on this rank
        self._closed = False
        self._tables: dict = {}

    @property
    def rank(self) -> int:
        return self.heap.rank

    @property
    def world_size(self) -> int:
        return self.heap.world_size

    @property
    def nbytes(self) -> int:
        """Bytes allocated on this rank (equals ``required_bytes`` of the regions)."""
        return self.layout.total

    def _check(self):
        if self._closed:
            raise BufferStateError("symmetric buffer is closed")

    def local(self, name: str) -> torch.Tensor:
        """This rank's tensor of region ``name`` (shape and dtype as declared)."""
        self._check()
        r = self.layout.region(name)
        off = self.layout.offsets[name]
        return self._bytes[off: off + r.nbytes].view(r.dtype).view(r.shape)

    def peer(self, name: str, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tensor of region ``name`` (a view into its memory; reads/writes go to that rank)."""
        self._check()
        if rank == self.rank:
            return self.local(name)
        return self.heap._peer_view(self, name, rank)

    def address(self, name: str, rank: int) -> int:
        """Address of region ``name`` on rank ``rank`` (valid in this process / on this device)."""
        return self.base_ptrs[rank] + self.layout.offsets[name]

    def ptr_table(self, name: str) -> torch.Tensor:
        """int64 tensor ``[world_size]`` of every rank's address of region ``name``, on the heap's device."""
        self._check()
        t = self._tables.get(name)
        if t is None:
            t = torch.tensor([self.address(name, r) for r in range(self.world_size)], dtype=torch.int64,
                             device=self.heap.device)
            self._tables[name] = t
        return t

    def barrier(self):
        """Collective barrier of the heap's group (host-blocking)."""
        self.heap.barrier()

    def close(self):
        """Release this rank's allocation (collective: every rank closes its buffers in the same order)."""
        if not self._closed:
            self._closed = True
            self._tables.clear()
            self.heap._free(self)


class SymmetricHeap:
    """Interface of a symmetric heap bound to one process group."""

    rank: int
    world_size: int
    device: torch.device
    group: object

    def allocate(self, regions: Sequence[Region], zero: bool = True) -> SymmetricBuffer:  # pragma: no cover
        raise NotImplementedError

    def barrier(self):
        """Barrier of the heap's group ordering this rank's device work (:func:`tritonep.memory.group_barrier`)."""
        group_barrier(self.group, self.device)

    def _peer_view(self, buf: SymmetricBuffer, name: str, rank: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def _free(self, buf: SymmetricBuffer):  # pragma: no cover
        raise NotImplementedError

    def _gather(self, value: int) -> list:
        """Every rank's ``value`` (one small all_gather of the heap's group), in rank order."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.group)
        return [int(o.item()) for o in out]

    def _check_symmetric(self, value: int, what: str):
        """All ranks must agree on ``value`` (offset, size); raises HeapError on every rank naming the values."""
        vals = self._gather(value)
        if len(set(vals)) != 1:
            raise HeapError(f"symmetric allocation diverged across ranks: {what} per rank = {vals}")


class CpuHeap(SymmetricHeap):
    """Fork-shared mmap heap for multi-rank worlds on one CPU (docs/platform.md).

    Create it in the parent with :meth:`create` *before* forking, then call :meth:`attach` in each rank.

    Args:
        world_size: ranks that share the mapping (>= 1).
        slice_bytes: bytes of each rank's slice (rounded up to 4096).

    Raises:
        HeapError: ``world_size < 1`` or a mapping that cannot be made (the message names the sizes).
    """

    MAX_WORLD = 64

    def __init__(self, world_size: int, slice_bytes: int):
        if not 1 <= world_size <= self.MAX_WORLD:
            raise HeapError(f"CPU heap holds 1..{self.MAX_WORLD} ranks, got world_size={world_size}")
        self.world_size = int(world_size)
        self.slice_bytes = (int(slice_bytes) + 4095) // 4096 * 4096
        try:
            self._mm = mmap.mmap(-1, self.world_size * self.slice_bytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        except (OSError, OverflowError, ValueError) as e:
            raise HeapError(f"cannot map {self.world_size} x {self.slice_bytes} bytes: {e}") from e
        self._all = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.base = self._all.data_ptr()
        self.rank = -1
        self.group = None
        self.device = torch.device("cpu")
        self._live: dict = {}  # allocation id -> (offset, nbytes), the buffers not yet freed
        self._next_id = 0

    @classmethod
    def create(cls, world_size: int, slice_bytes: int) -> "CpuHeap":
        return cls(world_size, slice_bytes)

    def attach(self, rank: int, group=None) -> "CpuHeap":
        """Bind this (forked) process to rank ``rank`` of ``group`` (default: the world group)."""
        if not 0 <= rank < self.world_size:
            raise HeapError(f"rank {rank} outside the heap's world of {self.world_size}")
        self.rank = int(rank)
        self.group = group
        return self

    def slice(self, rank: int) -> torch.Tensor:
        return self._all[rank * self.slice_bytes: (rank + 1) * self.slice_bytes]

    def free_extents(self) -> list:
        """The free extents of this rank's slice, ``[(offset, nbytes), ...]`` in offset order (neighbours coalesced:
        a freed buffer next to free space forms one extent with it)."""
        out, pos = [], 0
        for off, n in sorted(self._live.values()):
            if off > pos:
                out.append((pos, off - pos))
            pos = max(pos, off + n)
        if pos < self.slice_bytes:
            out.append((pos, self.slice_bytes - pos))
        return out

    def _fit(self, nbytes: int) -> int:
        """First fit: the lowest offset of a free extent that holds ``nbytes``, or -1."""
        for off, n in self.free_extents():
            if n >= nbytes:
                return off
        return -1

    def allocate(self, regions: Sequence[Region], zero: bool = True) -> SymmetricBuffer:
        """Allocate ``regions`` at the same offset of every rank's slice (collective: every rank allocates and
        frees in the same order).

        The buffer takes the lowest free extent that holds it (first fit), so space freed anywhere (not only at
        the top) is reused: a rebuild-on-capacity loop (new buffer, then close the old one) runs in a heap sized
        for two buffers. Every rank's offset (or its lack of space) is exchanged in one all_gather, so a buffer
        that does not fit raises on every rank.

        Raises:
            HeapError: the heap is not attached, or the ranks' offsets / sizes differ (diverged sequences).
            LayoutError: no free extent holds the buffer (on every rank; the message names the bytes needed, the
                largest free extent and the free bytes).
        """
        if self.rank < 0:
            raise HeapError("CPU heap is not attached to a rank (call attach(rank) in the forked process)")
        lay = layout(regions)
        off = self._fit(lay.total)
        if self.group is not None or dist.is_initialized():
            offs = self._gather(off)
            if -1 in offs or len(set(offs)) != 1:
                short = [r for r, o in enumerate(offs) if o < 0]
                if not short:
                    raise HeapError(f"symmetric allocation diverged across ranks: CPU heap offset per rank = {offs}")
                off = -1
            self._check_symmetric(lay.total, "CPU heap allocation size")
        if off < 0:
            ext = self.free_extents()
            raise LayoutError(
                f"CPU heap: a buffer of {lay.total} bytes ({len(lay.regions)} regions) does not fit in this rank's "
                f"slice of {self.slice_bytes} bytes: {sum(n for _, n in ext)} bytes free in {len(ext)} extents, "
                f"the largest {max((n for _, n in ext), default=0)} bytes, {len(self._live)} buffers live (raise "
                f"TRITONEP_CPU_HEAP_BYTES or run_cpu_world(heap_bytes=...), or close buffers first)")
        aid = self._next_id
        self._next_id += 1
        self._live[aid] = (off, lay.total)
        local = self.slice(self.rank)[off: off + lay.total]
        if zero:
            local.zero_()
        bases = [self.base + r * self.slice_bytes + off for r in range(self.world_size)]
        buf = SymmetricBuffer(self, lay, bases, local)
        buf._heap_offset = off
        buf._heap_id = aid
        if dist.is_initialized():
            self.barrier()
        return buf

    def _peer_view(self, buf: SymmetricBuffer, name: str, rank: int) -> torch.Tensor:
        r = buf.layout.region(name)
        off = buf._heap_offset + buf.layout.offsets[name]
        return self.slice(rank)[off: off + r.nbytes].view(r.dtype).view(r.shape)

    def _free(self, buf: SymmetricBuffer):
        """Return ``buf``'s extent to the free space (no collective; :meth:`allocate`'s all_gather orders a later
        reuse after every rank's close: kernels run synchronously in the interpreter, so none still touches it)."""
        self._live.pop(buf._heap_id, None)

    @property
    def used_bytes(self) -> int:
        """Bytes of this rank's slice held by live buffers."""
        return sum(n for _, n in self._live.values())


class CudaHeap(SymmetricHeap):
    """CUDA symmetric heap over ``torch.distributed._symmetric_memory`` (one ``symm_mem.empty`` per buffer).

    Args:
        group: the process group whose ranks share the buffers: NCCL with one GPU per rank, or gloo for ranks that
            share a GPU (then set ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, as
            :func:`tritonep.testing.run_gpu_world` does; docs/platform.md).
        device: this rank's CUDA device.
    """

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._handles: dict = {}

    def allocate(self, regions: Sequence[Region], zero: bool = True) -> SymmetricBuffer:
        import torch.distributed._symmetric_memory as symm_mem

        lay = layout(regions)
        self._check_symmetric(lay.total, "CUDA symmetric allocation size")
        t = symm_mem.empty(lay.total, dtype=torch.uint8, device=self.device)
        hdl = symm_mem.rendezvous(t, self.group)
        off = t.data_ptr() - int(hdl.buffer_ptrs[self.rank])
        if off < 0:
            raise HeapError(f"symmetric tensor lies before its allocation base (offset {off})")
        if zero:
            t.zero_()
        torch.cuda.synchronize(self.device)
        bases = [int(p) + off for p in hdl.buffer_ptrs]
        buf = SymmetricBuffer(self, lay, bases, t)
        buf._handle = hdl
        buf._base_offset = off
        self.barrier()
        return buf

    def _peer_view(self, buf: SymmetricBuffer, name: str, rank: int) -> torch.Tensor:
        r = buf.layout.region(name)
        off = buf._base_offset + buf.layout.offsets[name]
        return buf._handle.get_buffer(rank, [r.nbytes], torch.uint8, off).view(r.dtype).view(r.shape)

    def _free(self, buf: SymmetricBuffer):
        buf._handle = None
        buf._bytes = None


_CPU_HEAP: CpuHeap | None = None


def install_cpu_heap(heap: CpuHeap | None):
    """Make ``heap`` the process's CPU heap (done by :func:`tritonep.testing.run_cpu_world` in each rank)."""
    global _CPU_HEAP
    _CPU_HEAP = heap


def installed_cpu_heap() -> CpuHeap | None:
    return _CPU_HEAP


_CUDA_HEAPS: dict = {}


def get_heap(group=None, device: torch.device | str | None = None) -> SymmetricHeap:
    """The symmetric heap for ``group`` on ``device``.

    CPU: the heap installed by the CPU world (its world must match the group's size). CUDA: one
    :class:`CudaHeap` per (group, device), created on first use.

    Raises:
        HeapError: no CPU heap installed, or a group larger than the heap's world.
        ConfigError: an unsupported device type.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    ws = dist.get_world_size(group) if dist.is_initialized() else 1
    if device.type == "cpu":
        heap = _CPU_HEAP
        if heap is None:
            raise HeapError("no CPU symmetric heap installed: a CPU EPBuffer / MoELayer lives in the forked ranks of "
                            "tritonep.testing.run_cpu_world(world_size, fn), which share one heap: build it inside fn "
                            "(or tritonep.memory.install_cpu_heap(CpuHeap.create(...).attach(rank))); on your own gloo group "
                            "(torchrun) pass backend='nccl', which maps no peer memory")
        if ws != heap.world_size:
            raise HeapError(f"group has world_size={ws} but the CPU heap holds {heap.world_size} ranks")
        if heap.group is None and group is not None:
            heap.group = group
        return heap
    if device.type == "cuda":
        key = (id(group), device.index)
        if key not in _CUDA_HEAPS:
            _CUDA_HEAPS[key] = CudaHeap(group, device)
        return _CUDA_HEAPS[key]
    raise ConfigError(f"no symmetric heap for device type {device.type!r} (supported: cpu, cuda)")
