"""The CPU symmetric heap reuses freed space wherever it lies.

The heap used to reclaim only the top of its allocation stack: a rebuild-on-capacity loop (build the new buffer,
then close the old one) failed at its fifth cycle with a LayoutError on a heap sized for six buffers. Now
allocation is first-fit over coalesced free extents, with the same offsets on every rank (allocation is collective
and deterministic). Cases, each in a CPU world with the heap's per-rank slice sized tightly:

* the rebuild loop with EPBuffers (each cycle's buffer moves rows exactly as the reference), in a heap that holds
  two buffers, and with virtual-expert MoE layers (three allocations each, alternating sizes, so a new layer only
  fits once the holes of the old one coalesce);
* a freed extent in the middle of the slice, next to another freed one, takes a buffer of their joint size, zeroed,
  and peers reach it at the same offset;
* closing a zero-byte buffer frees nothing else (the old heap freed every stack entry that shared its offset, so a
  live neighbour's bytes were handed out again);
* a buffer larger than every free extent raises LayoutError on every rank naming the largest extent, and the heap
  stays usable.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import LayoutError
from tritonep.memory import Region, get_heap
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import diff, expected
from tests.support.hooks import backend_of

W, E, H, K = 2, 4, 64, 2


def _buf_bytes(tmax):
    return tep.EPBuffer.required_bytes(world_size=W, num_experts=E, hidden=H, max_tokens_per_rank=tmax, topk=K,
                                       device_type="cpu")


def _rebuild_world(group, cycles):
    rank = dist.get_rank(group)
    out, old = [], None
    for c in range(cycles):
        new = tep.EPBuffer(group, E, H, 8, K)
        x, idx, w = make_rank_inputs(rank, 6, H, E, K, seed=c)
        d = new.dispatch(x, idx, w)
        out.append((d.x.clone(), d.num_tokens_per_expert.clone(), backend_of(new).buf._heap_offset))
        if old is not None:
            old.close()
        old = new
    old.close()
    return out, get_heap(group, "cpu").used_bytes


def test_rebuild_before_close_loop_runs_in_a_heap_for_two_buffers():
    cycles = 6
    res = run_cpu_world(W, _rebuild_world, cycles, timeout_s=240, heap_bytes=2 * _buf_bytes(8) + 4096)
    for c in range(cycles):
        want = expected([make_rank_inputs(r, 6, H, E, K, seed=c) for r in range(W)], E)
        offs = {res[r][0][c][2] for r in range(W)}
        assert len(offs) == 1, f"cycle {c}: offsets differ across ranks {offs}"
        for r in range(W):
            got_x, got_n, _ = res[r][0][c]
            assert diff(dict(x=got_x, ntpe=got_n), want[r]) == [], (c, r)
    assert [res[0][0][c][2] for c in range(cycles)][:3] == [0, _buf_bytes(8), 0]  # the two places alternate
    assert all(used == 0 for _, used in res)


def _layer_rebuild_world(group, tmaxes):
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank(group)
    old, out = None, []
    for i, tmax in enumerate(tmaxes):
        geo = MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=tmax)
        new = MoELayer(MoERecipe(balance="virtual", combine="push"), geo, group, timeout_s=60)
        x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=i)
        y = new(x, topk_idx=idx, topk_weights=w)
        out.append((tuple(y.shape), bool(torch.isfinite(y.float()).all()), backend_of(new.buffer).buf._heap_offset))
        if old is not None:
            old.close()
        old = new
    old.close()
    return out, get_heap(group, "cpu").used_bytes


def test_virtual_layer_rebuild_loop_reuses_coalesced_holes():
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    def size(t):
        geo = MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=t)
        return MoELayer.required_bytes(MoERecipe(balance="virtual", combine="push"), geo, W, device_type="cpu")

    tmaxes = [8, 16, 8, 16]
    heap = size(8) + size(16) + 4096  # the third layer fits only in the first one's coalesced holes
    res = run_cpu_world(W, _layer_rebuild_world, tmaxes, timeout_s=240, heap_bytes=heap)
    for r in range(W):
        shapes = [o[:2] for o in res[r][0]]
        assert shapes == [((5, H), True)] * len(tmaxes), shapes
        assert res[r][1] == 0
    assert res[0][0][2][2] == res[0][0][0][2] == 0  # layer 3's EPBuffer took layer 1's place


def _middle_world(group):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    heap = get_heap(group, "cpu")
    a = heap.allocate([Region("a", (1024,), torch.uint8)])
    b = heap.allocate([Region("b", (2048,), torch.uint8)])
    c = heap.allocate([Region("c", (1024,), torch.uint8)])
    a.local("a").fill_(7)
    b.local("b").fill_(7)
    b.close()
    a.close()
    ext = getattr(heap, "free_extents", lambda: None)()  # (the stack-only heap had no free list)
    d = heap.allocate([Region("d", (3072,), torch.uint8)])
    zeroed = bool((d.local("d") == 0).all())
    dist.barrier(group)  # every rank has looked before any peer writes
    d.peer("d", (rank + 1) % world)[rank * 8: rank * 8 + 8] = rank + 1  # every rank writes into the next one's copy
    dist.barrier(group)
    got = d.local("d")[:8 * world].clone()
    res = dict(ext=ext, d=d._heap_offset, c=c._heap_offset, zeroed=zeroed, got=got)
    d.close()
    c.close()
    res["used"] = heap.used_bytes
    return res


def test_freed_middle_extents_coalesce_and_take_a_larger_buffer():
    res = run_cpu_world(3, _middle_world, timeout_s=60, heap_bytes=8192)
    for r, out in enumerate(res):
        assert out["d"] == 0 and out["c"] == 3072 and out["zeroed"], out
        assert out["ext"] == [(0, 3072), (4096, 8192 - 4096)], out["ext"]
        prev = (r - 1) % 3
        want = torch.zeros(24, dtype=torch.uint8)
        want[prev * 8: prev * 8 + 8] = prev + 1
        assert torch.equal(out["got"], want), (r, out["got"])
        assert out["used"] == 0


def _zero_size_world(group):
    heap = get_heap(group, "cpu")
    z = heap.allocate([Region("z", (0,), torch.uint8)])
    live = heap.allocate([Region("live", (512,), torch.uint8)])
    live.local("live").fill_(9)
    z.close()
    z.close()  # idempotent
    new = heap.allocate([Region("new", (512,), torch.uint8)])
    new.local("new").fill_(3)
    res = (live._heap_offset, new._heap_offset, bool((live.local("live") == 9).all()))
    new.close()
    live.close()
    return res


def test_closing_a_zero_byte_buffer_frees_nothing_else():
    for live_off, new_off, intact in run_cpu_world(2, _zero_size_world, timeout_s=60, heap_bytes=8192):
        assert new_off >= live_off + 512 or new_off + 512 <= live_off, (live_off, new_off)
        assert intact, "a live buffer's bytes were handed to a new buffer"


def _no_fit_world(group):
    heap = get_heap(group, "cpu")
    parts = [heap.allocate([Region("p", (2048,), torch.uint8)]) for _ in range(4)]  # the whole 8 KiB slice
    parts[0].close()
    parts[2].close()  # 4 KiB free in two extents of 2 KiB
    try:
        heap.allocate([Region("big", (3000,), torch.uint8)])
        err = None
    except LayoutError as e:
        err = str(e)
    fits = heap.allocate([Region("small", (2048,), torch.uint8)])  # still usable: the first hole
    return err, fits._heap_offset


def test_buffer_larger_than_every_free_extent_raises_on_every_rank():
    for err, off in run_cpu_world(3, _no_fit_world, timeout_s=60, heap_bytes=8192):
        assert err is not None and "3072 bytes" in err and "the largest 2048 bytes" in err, err
        assert "4096 bytes free in 2 extents" in err, err
        assert off == 0


def _gpu_rebuild_world(group, cycles):
    """World 1 on one GPU: build the next buffer, then close the old one; free device memory after each cycle."""
    import gc

    dev = torch.device("cuda", torch.cuda.current_device())
    old, free = None, []
    for c in range(cycles):
        new = tep.EPBuffer(group, 16, 2048, 1024, 4)
        x, idx, w = (t.to(dev) for t in make_rank_inputs(0, 64, 2048, 16, 4, seed=c))
        new.dispatch(x, idx, w)
        if old is not None:
            old.close()
        old = new
        gc.collect()
        torch.cuda.synchronize()
        free.append(torch.cuda.mem_get_info()[0])
    old.close()
    return free


@pytest.mark.world1
@pytest.mark.gpu
@pytest.mark.alone  # free device memory is the whole GPU's: another process beside it moves it
def test_gpu_rebuild_loop_returns_closed_buffers_memory(gpu_world):
    """CUDA heap: each buffer is its own symm_mem allocation, so a closed one must give its memory back (no heap
    offsets to fragment); 12 rebuild cycles may not lose more than one buffer's bytes of free device memory."""
    nbytes = tep.EPBuffer.required_bytes(world_size=1, num_experts=16, hidden=2048, max_tokens_per_rank=1024, topk=4)
    free = gpu_world(1, _gpu_rebuild_world, 12, timeout_s=600)[0]
    lost = free[1] - min(free[1:])
    assert lost <= nbytes, f"free device memory fell by {lost} bytes over 11 cycles (one buffer: {nbytes})"
