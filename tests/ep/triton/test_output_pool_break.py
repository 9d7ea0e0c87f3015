"""Adversarial callers of the output pool (:mod:`tritonep.ep.triton.pool`), differential: the same script of calls
runs in the CPU world of 2 ranks with the pool on (``TRITONEP_OUTPUT_POOL=1``: one set per stream, so every release
is reused by the very next call) and off (``0``), and every value a caller kept is read at the END of the script;
the two runs must agree bitwise (the kernels are deterministic), so any kept output the pool handed out again shows.

What the caller keeps, each time as the ONLY reference, over later calls (synced, sync-free, refused, autograd):
the storage object of the rows / of the handle block (``untyped_storage()``: the pool's own Python object, no use
count moves; missed before session 8's fix), a DLPack capsule of ``handle.store`` (a C++ holder of a base whose
TensorImpl the set's own views already share: no Python count moves; missed before the fix), the row weights, a view
of a view of ``expert_offsets``, ``num_tokens_per_expert`` in a closure, the handle alone (combined after later
calls), the combine output (decode: pooled), a refused call's exception (its traceback holds the call's set), two
autograd graphs backwarded after later calls (the second one twice, ``retain_graph``), and a sync-free call's
outputs over a synced one. Also: an in-place op on a differentiable combine output (decode: a view of the pooled
block), of ``EPBuffer.combine`` and of the ``tritonep::combine`` op, works as without the pool (it raised "a view
created inside a custom Function" before the fix), and ``close`` lets the pool's blocks go (it kept them while the
buffer object lived).

The pool's own rules for the two new counts: :func:`test_pool_counts_storage_objects_and_base_holders`.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import CapacityError, InputError, PeerInputError
from tritonep.ep.triton.pool import OutputPool
from tritonep.testing import run_cpu_world
from tritonep.testing.harness import _host, expert, make_calls, open_buffer, set_env

CFG = dict(E=8, H=64, Tmax=8, K=3, A=4)


def _make():
    s = torch.zeros(256, dtype=torch.int32)
    return (s,), (s[0:8], s[64:72])


def test_pool_counts_storage_objects_and_base_holders():
    p = OutputPool(_make, 1, torch.device("cpu"))
    holders = [
        lambda a: a[1].untyped_storage(),  # the storage object of a view (the pool's own object)
        lambda a: a[2].untyped_storage(),
        lambda a: torch.utils.dlpack.to_dlpack(a[0]),  # a C++ holder of the base
        lambda a: a[0].__dlpack__(),
    ]
    for i, hold in enumerate(holders):
        a = p.take()
        assert a is not None, f"holder {i - 1} was not released"
        h = hold(a)
        del a
        assert p.take() is None, f"holder {i}: a set held only by {type(h).__name__} was handed out again"
        del h
    assert p.take() is not None


def _view_from(storage, like):
    """A tensor over ``storage`` with ``like``'s (dtype, offset, shape, strides)."""
    dtype, off, shape, stride = like
    return torch.empty(0, dtype=dtype).set_(storage, off, shape, stride)


def _meta(t):
    return t.dtype, t.storage_offset(), tuple(t.shape), t.stride()


def _world(group, geometry, pool, calls):
    set_env(TRITONEP_GEOMETRY=geometry or None, TRITONEP_OUTPUT_POOL=pool)
    rank = dist.get_rank(group)
    buf = open_buffer(group, CFG)
    hl = buf._impl.hl
    c0, c1, c2 = calls[rank]
    kept, out = {}, {}

    def grad_fwd(c):
        x = c[0].clone().requires_grad_(True)
        w = c[2].clone().requires_grad_(True)
        d = buf.dispatch(x, c[1], w)
        y = buf.combine(expert(d.x) * 1.0, d.handle)
        return (y.float() * (1.0 + rank)).sum(), x, w

    # the storage objects alone (rows: the decode geometry pools them; the handle block on every geometry)
    d = buf.dispatch(*c0)
    kept["st_x"], kept["st_n"] = d.x.untyped_storage(), d.num_tokens_per_expert.untyped_storage()
    kept["m_x"], kept["m_n"] = _meta(d.x), _meta(d.num_tokens_per_expert)
    # a first graph, backwarded after later calls
    loss_a, xa, wa = grad_fwd(c1)
    d = buf.dispatch(*c1)
    kept["cap"], kept["m_c"] = torch.utils.dlpack.to_dlpack(d.handle.store), hl.tensor(d.handle.store, "counts")
    kept["m_c"] = _meta(kept["m_c"])
    d = buf.dispatch(*c2)
    kept["w"] = d.weights
    d = buf.dispatch(*c0)
    kept["vv"] = d.expert_offsets[1:][:2]
    d = buf.dispatch(*c1)
    kept["closure"] = (lambda n=d.num_tokens_per_expert: n)
    d = buf.dispatch(*c2)
    kept["handle"], kept["eo"] = d.handle, expert(d.x)
    d = buf.dispatch(*c0)
    kept["y"] = buf.combine(expert(d.x), d.handle)
    # a refused call (an id outside [-1, E) on rank 1): its exception (traceback) kept
    bad = c1[1].clone()
    if rank == 1 and bad.numel():
        bad[0, 0] = 99
    try:
        buf.dispatch(c1[0], bad, c1[2])
        kept["err"] = None
    except (InputError, PeerInputError) as e:
        kept["err"] = e
    # T > max_tokens_per_rank on rank 0: refused everywhere
    big = [torch.zeros(CFG["Tmax"] + 1, CFG["H"], dtype=torch.bfloat16), torch.zeros(CFG["Tmax"] + 1, CFG["K"],
                                                                                      dtype=torch.int64),
           torch.ones(CFG["Tmax"] + 1, CFG["K"])]
    try:
        buf.dispatch(*(big if rank == 0 else c2))
        out["capacity"] = "none"
    except (CapacityError, PeerInputError) as e:
        out["capacity"] = type(e).__name__
    # a sync-free call's outputs kept over a synced one
    d = buf.dispatch(*c2, sync_free=True)
    kept["sf"] = (d.x, d.weights, d.expert_offsets)
    d = buf.dispatch(*c1)
    kept["synced"] = (d.x, d.weights, d.num_tokens_per_expert)
    # a second graph; the first one backwarded now, the second twice (retain_graph) around more calls
    loss_b, xb, wb = grad_fwd(c2)
    loss_a.backward()
    loss_b.backward(retain_graph=True)
    for c in (c0, c1, c2):
        d = buf.dispatch(*c)
        buf.combine(expert(d.x), d.handle)
    loss_b.backward()
    # an in-place op on a differentiable combine output (residual add)
    x = c0[0].clone().requires_grad_(True)
    d = buf.dispatch(x, c0[1], c0[2])
    from tritonep.ep import ops  # imported in the rank (the kernels must load under the interpreter)

    od = ops.dispatch(ops.buffer_id(buf), x, c0[1], c0[2])  # the custom ops' autograd (torch.library)
    try:
        y = buf.combine(expert(d.x) * 1.0, d.handle)
        y.add_(1.0)
        y = ops.combine(expert(od.x) * 1.0, od)
        y.add_(1.0)
        out["inplace"] = "ok"
    except RuntimeError as e:
        out["inplace"] = str(e)[:80]
    del d, od, x, y
    for c in (c0, c1, c2):  # more reuse before the kept values are read
        d = buf.dispatch(*c)
        buf.combine(expert(d.x), d.handle)
    del d
    # read everything kept, now
    out["st_x"] = _host(_view_from(kept["st_x"], kept["m_x"]))
    out["st_n"] = _host(_view_from(kept["st_n"], kept["m_n"]))
    store = torch.from_dlpack(kept["cap"])
    out["cap"] = _host(store[kept["m_c"][1]:].view(kept["m_c"][0])[:kept["m_c"][2][0]])
    for k in ("w", "vv", "y"):
        out[k] = _host(kept[k])
    out["closure"] = _host(kept["closure"]())
    out["handle_y"] = _host(buf.combine(kept["eo"], kept["handle"]))
    out["handle_counts"] = _host(kept["handle"].counts)
    out["err"] = type(kept["err"]).__name__
    out["sf"] = [_host(t) for t in kept["sf"]]
    out["sf"][0] = out["sf"][0][:int(out["sf"][2][-1])]  # rows past expert_offsets[-1] are unspecified
    out["synced"] = [_host(t) for t in kept["synced"]]
    out["grads"] = [_host(t.grad) for t in (xa, wa, xb, wb)]
    del kept, store, loss_a, loss_b
    buf.close()
    impl = buf._impl
    out["pool_bytes_after_close"] = impl.output_pool_bytes
    return out


def _equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            _equal(u, v, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("geometry", ["", "bt=2,dec=3"], ids=["two-kernel", "decode"])
def test_kept_by_adversarial_callers(geometry):
    calls = make_calls(2, CFG, [7, 5], [21, 22, 23], mask_frac=0.2)
    on = run_cpu_world(2, _world, geometry, "1", calls, timeout_s=300)
    off = run_cpu_world(2, _world, geometry, "0", calls, timeout_s=300)
    for rank in range(2):
        assert on[rank]["inplace"] == "ok", f"rank {rank}: {on[rank]['inplace']}"
        assert on[rank]["capacity"] == off[rank]["capacity"] != "none"
        assert on[rank]["err"] in ("InputError", "PeerInputError")
        assert on[rank]["pool_bytes_after_close"] == 0, "close kept the pool's blocks"
        _equal(on[rank], off[rank], f"rank {rank}")
