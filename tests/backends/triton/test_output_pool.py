"""The output pool of the triton backend (:mod:`tritonep.runtime.pool`): a dispatch's handle storage and views (and
on the decode geometry its rows and the combine's output) are reused only once nobody holds any of them.

Checked: the pool's own rules (a held tuple, tensor, view of a tensor or a view of the storage keeps a set; a set is
reused once released; ``slots`` bounds the sets; ``slots=0`` is off); in the CPU world of 2 ranks on every geometry
(two kernels, fused, decode): outputs a caller keeps over later calls are never overwritten (every kept record equal
to the reference after all the calls), a caller that drops its outputs gets the same block back (the pool is
used: no allocation), ``TRITONEP_OUTPUT_POOL=0`` turns it off, and autograd state never travels with a reused set
(an inference call after a differentiable one, or after a caller's in-place op with a differentiable operand on its
outputs, returns tensors without ``grad_fn``). The decode geometry's sets (handle block + rows: one take per call)
and combine outputs come from pools shared by the buffers of one shape (one per MoE layer), dropped with their last
buffer. Reuse under
poison: ``test_handle_poison.py``.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.runtime.pool import OutputPool
from tritonep.testing import run_cpu_world
from tests.support.harness import (check_calls, expert, make_calls, open_buffer, record, run_grad_call,
                                      set_env)
from tests.support.hooks import backend_of

CFG = dict(E=8, H=64, Tmax=8, K=3, A=4)
GEOMETRIES = pytest.mark.parametrize("geometry", ["", "fs=2,fe=2,fc=1", "bt=2,dec=3"],
                                     ids=["two-kernel", "fused", "decode"])


def _make():
    s = torch.zeros(256, dtype=torch.int32)
    o = torch.zeros(4, 8)
    return (s, o), (s[0:8], s[64:72], s[128:200].view(torch.float32))


def test_pool_rules():
    p = OutputPool(_make, 2, torch.device("cpu"))
    a = p.take()
    assert len(a) == 5 and p.nbytes == 256 * 4 + 4 * 8 * 4
    b = p.take()
    assert b is not a and p.take() is None  # two sets, both held (as tuples)
    del a
    a = p.take()
    assert a is not None and p.take() is None
    held = [a[1][:2], a[0], a[4], a[0][10:20].view(torch.float32)]  # a view, a base, a pooled view, a storage view
    del a, b
    while held:  # any one of them keeps its set: only the other one is handed out
        got = p.take()
        mine = {t.untyped_storage().data_ptr() for t in got[:2]}
        assert not mine & {h.untyped_storage().data_ptr() for h in held}, "the held set was handed out"
        assert p.take() is None, f"a set held by {len(held)} outside tensors was handed out again"
        del got
        held.pop(0)
    x, y = p.take(), p.take()
    assert x is not None and y is not None and x is not y
    assert OutputPool(_make, 0, torch.device("cpu")).take() is None


def test_stream_key_and_held_first():
    """A caller's stream key serves the take (None, a capturing stream: nothing pooled); a set held since long ago,
    which is checked first (least recently handed out), is passed over every time, whatever holds it (a view, the
    storage object, the tuple: the last two move neither the storage use count nor the base's reference count that
    the quick check reads, so the full count must catch them)."""
    p = OutputPool(_make, 2, torch.device("cpu"))
    assert p.stream_key() == 0 and p.take(None) is None and p.nbytes == 0
    for holder in (lambda s: s[2], lambda s: s[0].untyped_storage(), lambda s: s):
        p = OutputPool(_make, 2, torch.device("cpu"))
        kept = p.take(0)
        ptr = kept[0].untyped_storage().data_ptr()
        h = holder(kept)
        del kept
        for _ in range(3):
            got = p.take(p.stream_key())
            assert got is not None and got[0].untyped_storage().data_ptr() != ptr, "a held set was handed out"
            del got
        assert len(p._sets[0]) == 2
        del h
        assert p.take(0)[0].untyped_storage().data_ptr() == ptr  # released: least recently handed out, first


def _world(group, geometry, pool, calls):
    set_env(TRITONEP_GEOMETRY=geometry or None, TRITONEP_OUTPUT_POOL=pool)
    rank = dist.get_rank(group)
    buf = open_buffer(group, CFG)
    # a caller that keeps every output of every call: no call may write into what an earlier one returned
    kept = []
    for x, idx, w in calls[rank]:
        d = buf.dispatch(x, idx, w)
        eo = expert(d.x)
        y = buf.combine(eo, d.handle)
        kept.append((d, eo, y))
    records = [record(d, eo, y) for d, eo, y in kept]  # read after all the calls
    del kept, d, eo, y
    # a caller that drops its outputs: every later call gets pooled blocks back (the sets made while the caller kept
    # everything, used in turn) and the pools make no new set
    impl = backend_of(buf)
    bytes_before = impl.output_pool_bytes
    ptrs = []
    for _ in range(3):
        d = buf.dispatch(*calls[rank][0])
        y = buf.combine(expert(d.x), d.handle)
        ptrs.append((d.handle.store.data_ptr(), d.x.data_ptr(), y.data_ptr()))
        del d, y
    pooled = set().union(*(p.base_ptrs() for p in impl.output_pools()))
    ptrs = (ptrs, pooled, bytes_before == impl.output_pool_bytes)
    # autograd state never travels with a set: an inference call after a differentiable one (synced and sync-free)
    grad = run_grad_call(buf, *calls[rank][1], grad_seed=3 + rank)
    xr = calls[rank][1][0].clone().requires_grad_(True)
    df = buf.dispatch(xr, calls[rank][1][1], calls[rank][1][2], sync_free=True)
    del df, xr
    flags = []
    for sync_free in (False, True):
        d = buf.dispatch(*calls[rank][1], sync_free=sync_free)
        flags += [d.x.requires_grad, d.weights.requires_grad, d.x.grad_fn is not None,
                  d.num_tokens_per_expert.requires_grad]
        del d
    # a caller's in-place op with a differentiable operand on outputs it was handed puts their autograd base (the
    # pooled rows, the row weights' float32 view of the block, the combine output) into its graph: such a set must
    # never come back with that mark (pool.py: _Set.marked)
    import gc

    p = torch.ones((), requires_grad=True)
    eo = buf.expert_out_buffer()
    for sync_free in (False, True):
        d = buf.dispatch(*calls[rank][1], sync_free=sync_free)
        y = buf.combine(eo, d.handle)
        d.x.mul_(p.to(d.x.dtype))
        d.weights.mul_(p)
        y.mul_(p.to(y.dtype))
        del d, y
        gc.collect()
        for _ in range(3):
            d = buf.dispatch(*calls[rank][1], sync_free=sync_free)
            y = buf.combine(eo, d.handle)
            flags += [d.x.requires_grad, d.weights.requires_grad, y.requires_grad]
            del d, y
    pool_bytes = backend_of(buf).output_pool_bytes
    buf.close()
    return records, ptrs, grad, flags, pool_bytes


@GEOMETRIES
def test_kept_outputs_intact_and_released_sets_reused(geometry):
    calls = make_calls(2, CFG, [7, 0], [11, 12, 13], mask_frac=0.2)
    res = run_cpu_world(2, _world, geometry, None, calls, timeout_s=300)
    check_calls(CFG, calls, [r[0] for r in res])
    check_calls(CFG, [[c[1]] for c in calls], [[r[2]] for r in res])
    for rank, (_, ptrs, _, flags, pool_bytes) in enumerate(res):
        assert pool_bytes > 0
        ptrs, pooled, no_new_set = ptrs
        assert no_new_set, f"rank {rank}: a caller that drops its outputs made the pools grow"
        assert all(p[0] in pooled for p in ptrs), f"rank {rank}: a handle block was not the pool's: {ptrs}"
        if geometry.startswith("bt=2,dec"):  # decode: the rows and the combine output are pooled too
            assert all(p[1] in pooled for p in ptrs), (rank, ptrs, pooled)
            assert all(p[2] in pooled or not p[2] for p in ptrs), (rank, ptrs, pooled)
        assert not any(flags), f"rank {rank}: an inference call returned autograd state: {flags}"


def test_pool_off():
    calls = make_calls(2, CFG, [7, 5], [11, 12], mask_frac=0.2)
    res = run_cpu_world(2, _world, "bt=2,dec=3", "0", calls, timeout_s=300)
    check_calls(CFG, calls, [r[0] for r in res])
    assert all(r[4] == 0 for r in res)


def test_shared_pools_follow_their_users():
    from tritonep.runtime import pool as P

    key, dev = ("rows", "test", 4, 8), torch.device("cpu")
    a = P.acquire_shared(key, _make, 2, dev)
    b = P.acquire_shared(key, _make, 2, dev)
    assert a is b and a.slots == 2
    assert P.acquire_shared(key, _make, 0, dev) is not a  # a pool off is never shared
    P.release_shared(key, 2)
    assert P.acquire_shared(key, _make, 2, dev) is a  # one user left: the same pool
    P.release_shared(key, 2)
    P.release_shared(key, 2)
    assert P.acquire_shared(key, _make, 2, dev) is not a  # the last user released it: a new one
    P.release_shared(key, 2)
    assert not any(k[0] == key for k in P._SHARED)


def _two_buffers_world(group, calls):
    from tritonep.runtime import pool as P

    set_env(TRITONEP_GEOMETRY="bt=2,dec=3", TRITONEP_OUTPUT_POOL=None)
    rank = dist.get_rank(group)
    one, two = open_buffer(group, CFG), open_buffer(group, CFG)  # two "layers" of the same shape
    ptrs, records = [], []
    for buf, c in zip((one, two, one, two), calls[rank]):
        d = buf.dispatch(*c)
        eo = expert(d.x)
        y = buf.combine(eo, d.handle)
        ptrs.append((d.x.data_ptr(), y.data_ptr(), d.handle.store.data_ptr()))
        records.append(record(d, eo, y))  # copies: read now, before the next layer's call reuses the set
        del d, y
    shared = (backend_of(one).outputs.decode_pool is backend_of(two).outputs.decode_pool
              and backend_of(one).outputs.ypool is backend_of(two).outputs.ypool)
    set_env(TRITONEP_GEOMETRY=None)  # a two-kernel buffer of the same shape: it never uses the decode pools, and
    other = open_buffer(group, CFG)  # its close must not take a user away from them (`kept` below)
    other.close()
    one.close()
    kept = any(e[0] is backend_of(two).outputs.decode_pool for e in P._SHARED.values())  # still used by `two`
    two.close()
    return ptrs, shared, kept, records


def test_decode_sets_shared_by_buffers_of_one_shape():
    """The decode geometry's one set per call (handle block + rows) and the combine output come from pools shared by
    the buffers of one shape: layers run one after another reuse the same blocks, and every call is still right."""
    calls = make_calls(2, CFG, [7, 5], [11, 12, 13, 14], mask_frac=0.2)
    res = run_cpu_world(2, _two_buffers_world, calls, timeout_s=300)
    check_calls(CFG, calls, [r[3] for r in res])
    for ptrs, shared, kept, _ in res:
        assert shared and kept
        # one rows block, one y block, one handle block: each layer's call hands the set back for the next layer
        assert len({p[0] for p in ptrs}) == 1 and len({p[1] for p in ptrs}) == 1, ptrs
        assert len({p[2] for p in ptrs}) == 1, ptrs


class _Keep(torch.autograd.Function):
    """Saves its second input for backward: a C++ holder of that tensor (no Python reference)."""

    @staticmethod
    def forward(ctx, x, kept):
        ctx.save_for_backward(kept)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (kept,) = ctx.saved_tensors
        return g * kept.sum(), None


def test_a_view_saved_by_autograd_keeps_its_set():
    p = OutputPool(_make, 1, torch.device("cpu"))
    got = p.take()
    x = torch.ones(3, requires_grad=True)
    y = _Keep.apply(x, got[3])  # only the autograd graph of y holds the pooled view (in C++)
    del got
    assert p.take() is None, "a view saved by autograd was handed out again"
    y.sum().backward()
    del y
    assert p.take() is not None
