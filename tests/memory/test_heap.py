"""Foundation: region layout, the CPU symmetric heap (world-size errors, symmetric offsets and peer views, no heap
outside a world), a peer-writing Triton kernel with epoch signals and its bounded wait."""

import time

import pytest
import torch

from tritonep.errors import HeapError, LayoutError
from tests.support.probe_heap import peer_wait_kernel, peer_write_kernel
from tritonep.memory import ALIGN, CpuHeap, Region, get_heap, layout, required_bytes
from tritonep.testing import run_cpu_world


def test_layout_is_aligned_and_sized():
    regs = [Region("a", (3,), torch.int8), Region("b", (5, 7), torch.float32), Region("c", (0,), torch.int64)]
    lay = layout(regs)
    assert lay.offsets == {"a": 0, "b": 256, "c": 512}
    assert all(o % ALIGN == 0 for o in lay.offsets.values())
    assert lay.total == required_bytes(regs) == 512


def test_layout_errors_name_the_numbers():
    with pytest.raises(LayoutError, match="needs 768 bytes but only 300"):
        layout([Region("a", (300,), torch.uint8), Region("b", (1,), torch.uint8)], capacity=300)
    with pytest.raises(LayoutError, match="duplicate"):
        layout([Region("a", (1,), torch.uint8), Region("a", (1,), torch.uint8)])
    with pytest.raises(LayoutError, match="negative"):
        Region("a", (-1,), torch.uint8)


def test_heap_world_size_errors():
    with pytest.raises(HeapError, match="world_size=0"):
        CpuHeap.create(0, 4096)
    with pytest.raises(HeapError, match="world_size=65"):
        CpuHeap.create(65, 4096)


def _peer_write_world(group, epochs, skip_rank):
    import torch.distributed as dist

    rank, W = dist.get_rank(), dist.get_world_size()
    heap = get_heap(group, "cpu")
    regs = [Region("data", (W, 8), torch.int64), Region("flags", (W,), torch.int64),
            Region("calls", (1,), torch.int64), Region("status", (8,), torch.int64)]
    buf = heap.allocate(regs)
    out = {"offset": buf._heap_offset, "nbytes": buf.nbytes, "required": required_bytes(regs), "epochs": []}
    for e in range(epochs):
        buf.local("calls").add_(1)
        if rank != skip_rank:
            peer_write_kernel[(1,)](buf.ptr_table("data"), buf.ptr_table("flags"), buf.local("calls"), N=8,
                                    rank=rank, W=W, WB=4)
        t0 = time.time()
        peer_wait_kernel[(1,)](buf.local("flags"), buf.local("calls"), buf.local("status"),
                               3 * 10**9 if skip_rank >= 0 else 60 * 10**9, W=W, WB=4, HAS_TIMER=False)  # ns
        out["epochs"].append(buf.local("data").clone())
        out["wait_s"] = time.time() - t0
        if skip_rank < 0:
            dist.barrier()  # this toy protocol has no consumer acks (the EP kernels do)
    out["status"] = buf.local("status").clone()
    buf.close()
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_peer_write_with_epoch_signals(world):
    res = run_cpu_world(world, _peer_write_world, 3, -1, timeout_s=60)
    offs = {r["offset"] for r in res}
    assert len(offs) == 1, "symmetric offsets differ across ranks"
    for r in res:
        assert r["nbytes"] == r["required"]
        for e, data in enumerate(r["epochs"]):
            n = e + 1
            want = torch.tensor([[n * 1000 + s * 100 + i for i in range(8)] for s in range(world)])
            assert torch.equal(data, want)
        assert int(r["status"][0]) == 0


def test_missing_peer_is_reported_by_the_bounded_wait():
    res = run_cpu_world(3, _peer_write_world, 1, 2, timeout_s=60)
    for r in res:
        assert int(r["status"][0]) == 1  # STATUS_TIMEOUT
        assert int(r["status"][1]) == 7  # the wait id
        assert int(r["status"][2]) == 2  # the peer that never arrived


def test_probe_kernels_compile_one_variant_for_every_rank_and_bound():
    """Triton's cache key (tests/support/variant_keys.py) of the probe launches is one for ranks 0-3 and for bounds of
    1 ns, 1 s + 1 ns and 2 s: the rank and the bound are runtime arguments it does not specialise (a constexpr rank
    gave each rank its own variant; a specialised int tells 1, multiples of 16 and the rest apart). (A bound of
    2**31 ns or more is an int64 argument, another variant whatever the specialisation.)"""
    from tests.support.variant_keys import key_text, launch_key

    t = torch.zeros(4, dtype=torch.int64)
    write = {key_text(launch_key(peer_write_kernel, [t, t, t], dict(N=8, rank=r, W=4, WB=4))) for r in range(4)}
    wait = {key_text(launch_key(peer_wait_kernel, [t, t, t, ns], dict(W=4, WB=4, HAS_TIMER=False)))
            for ns in (1, 10**9 + 1, 2 * 10**9)}
    assert (len(write), len(wait)) == (1, 1), (len(write), len(wait))


def _heap_symmetry(group):
    import torch.distributed as dist

    heap = get_heap(group, "cpu")
    a = heap.allocate([Region("x", (100,), torch.float32)])
    b = heap.allocate([Region("y", (3, 5), torch.int32)])
    # write into the next rank's copy through a peer view, read own after a barrier
    nxt = (dist.get_rank() + 1) % dist.get_world_size()
    b.peer("y", nxt).fill_(dist.get_rank() + 1)
    dist.barrier()
    got = b.local("y").clone()
    offs = (a._heap_offset, b._heap_offset)
    b.close()
    a.close()
    return offs, got, heap.used_bytes


def test_symmetric_offsets_and_peer_views():
    res = run_cpu_world(4, _heap_symmetry, timeout_s=60)
    assert len({r[0] for r in res}) == 1
    for r, (offs, got, used) in enumerate(res):
        prev = (r - 1) % 4
        assert torch.equal(got, torch.full((3, 5), prev + 1, dtype=torch.int32))
        assert used == 0  # closing in reverse order frees the heap


def test_no_heap_outside_world():
    from tritonep.memory import install_cpu_heap

    install_cpu_heap(None)
    with pytest.raises(HeapError, match="no CPU symmetric heap"):
        get_heap(None, "cpu")
