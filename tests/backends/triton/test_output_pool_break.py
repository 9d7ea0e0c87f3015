"""Adversarial callers of the output pool (:mod:`tritonep.runtime.pool`) in the CPU world of 2 ranks, with one set
per stream (``TRITONEP_OUTPUT_POOL=1``: a released set is reused by the very next call). Each scenario makes a call
whose set comes from the pool (checked), drops every output but one way of holding it, reads the held values at
once and again after a later call (with other values); the two reads must be equal bitwise. Autograd: two graphs
backwarded after later calls (the second twice) give the gradients of each graph backwarded at once.

What the caller keeps, each time as the ONLY reference, over later calls (synced, sync-free, refused, autograd):
the storage object of the rows / of the handle block (``untyped_storage()``: the pool's own Python object, no use
count moves), a DLPack capsule of ``handle.store`` (a C++ holder of a base whose
TensorImpl the set's own views already share: no Python count moves), the row weights, a view
of a view of ``expert_offsets``, ``num_tokens_per_expert`` in a closure, the handle alone (combined after later
calls), the combine output (decode: pooled), a refused call's exception (its traceback holds the call's set), two
autograd graphs (``retain_graph``), and a sync-free call's outputs over a synced one; a capacity refusal in
between. Also: an in-place op on a differentiable combine output (decode: a view of the pooled block), of
``EPBuffer.combine`` and of the ``tritonep::combine`` op, works as without the pool (it raised "a view created
inside a custom Function" before the fix), and ``close`` lets the pool's blocks go (it kept them while the buffer
object lived). Interpreter cycles: ``tritonep/runtime/interpreter_speed.py`` (the sets are reused at once, checked).

The pool's own rules for the two new counts: :func:`test_pool_counts_storage_objects_and_base_holders`.
"""

import gc

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import CapacityError, InputError, PeerInputError
from tritonep.runtime.pool import OutputPool
from tritonep.testing import run_cpu_world
from tests.support.harness import _host, expert, make_calls, open_buffer, set_env
from tests.support.hooks import backend_of

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


def _pooled(buf, t) -> bool:
    """Whether ``t`` lies in one of the buffer's pooled blocks (the scenario tests the pool, not a fresh block)."""
    impl, ptr = backend_of(buf), t.untyped_storage().data_ptr()
    return any(ptr in p.base_ptrs() for p in impl.output_pools())


def _world(group, geometry, pool, calls):
    set_env(TRITONEP_GEOMETRY=geometry or None, TRITONEP_OUTPUT_POOL=pool)
    rank = dist.get_rank(group)
    buf = open_buffer(group, CFG)
    c0, c1, c2 = calls[rank]
    out, pooled = {}, {}

    def churn():  # a later call (c1: a scenario keeps c0 or c2, whose values differ) reuses the set if "free"
        d = buf.dispatch(*c1)
        buf.combine(expert(d.x), d.handle)

    def grad_fwd(c):
        x = c[0].clone().requires_grad_(True)
        w = c[2].clone().requires_grad_(True)
        d = buf.dispatch(x, c[1], w)
        y = buf.combine(expert(d.x) * 1.0, d.handle)
        return (y.float() * (1.0 + rank)).sum(), x, w, d.handle.store

    def scenario(name, make):
        """``make() -> (a tensor of the call, read)``: the call's outputs are dropped but what ``read`` closes over;
        ``read()`` now and after later calls (host copies) are recorded."""
        probe, read = make()
        pooled[name] = _pooled(buf, probe)
        del probe
        now = read()
        churn()
        out[name] = (now, read())

    def storage_of(t):
        st, m = t.untyped_storage(), _meta(t)
        return lambda: _host(_view_from(st, m))

    def dlpack_store():
        d = buf.dispatch(*c2)
        cap, m = [torch.utils.dlpack.to_dlpack(d.handle.store)], _meta(backend_of(buf).hl.tensor(d.handle.store, "counts"))

        def read():  # a capsule is consumed once: its tensor (a C++ holder of the block as well) is read again
            cap[0] = torch.from_dlpack(cap[0]) if not isinstance(cap[0], torch.Tensor) else cap[0]
            return _host(cap[0][m[1]:m[1] + m[2][0]])
        return d.handle.store, read

    def via_handle():
        d = buf.dispatch(*c2)
        h, eo = d.handle, expert(d.x)
        return d.handle.store, lambda: [_host(buf.combine(eo, h)), _host(h.counts), _host(h.topk_weights)]

    def kept(c, pick, **kw):
        d = buf.dispatch(*c, **kw)
        t = pick(d)
        return d.handle.store, lambda: _host(t)

    def combined():
        d = buf.dispatch(*c0)
        y = buf.combine(expert(d.x), d.handle)
        return (y if geometry else d.handle.store), lambda: _host(y)  # decode: y is pooled

    def sync_free():
        d = buf.dispatch(*c2, sync_free=True)
        x, w, offs = d.x, d.weights, d.expert_offsets
        return d.handle.store, lambda: [_host(x[:int(offs[-1])]), _host(w), _host(offs)]  # rows past offs[-1]: unspec.

    def refused():  # an id outside [-1, E) on rank 1: every rank raises; the exception (its traceback) is kept
        bad = c1[1].clone()
        if rank == 1:
            bad[0, 0] = 99
        try:
            buf.dispatch(c1[0], bad, c1[2])
        except (InputError, PeerInputError) as e:
            err = e
        tb = err.__traceback__
        while "store" not in tb.tb_frame.f_locals:  # the refused call's own set (its frame holds it)
            tb = tb.tb_next
        return tb.tb_frame.f_locals["store"], lambda: type(err).__name__

    def autograd():  # two graphs backwarded after later calls (the second twice) == each one backwarded at once
        loss_a, xa, wa, probe = grad_fwd(c1)
        churn()
        loss_b, xb, wb, _ = grad_fwd(c2)
        churn()
        loss_a.backward()
        loss_b.backward(retain_graph=True)
        churn()
        loss_b.backward()
        later = [_host(t.grad) for t in (xa, wa, xb, wb)]
        del loss_a, loss_b, xa, wa, xb, wb
        now = []
        for c in (c1, c2):
            loss, x, w, _ = grad_fwd(c)
            loss.backward()
            if c is c2:
                loss, *_ = grad_fwd(c)  # the second graph, twice
                loss.backward(retain_graph=True)
                loss.backward()
            now += [_host(x.grad), _host(w.grad)]
        now[2], now[3] = now[2] * 2, now[3] * 2  # b's grads accumulated twice
        pooled["autograd"], out["autograd"] = _pooled(buf, probe), (now, later)

    if geometry:  # decode: the rows are pooled
        scenario("storage_x", lambda: (lambda d: (d.x, storage_of(d.x)))(buf.dispatch(*c0)))
    scenario("storage_n", lambda: (lambda d: (d.handle.store, storage_of(d.num_tokens_per_expert)))(
        buf.dispatch(*c0)))
    scenario("dlpack_store", dlpack_store)
    scenario("weights", lambda: kept(c2, lambda d: d.weights))
    scenario("view_of_view", lambda: kept(c0, lambda d: d.expert_offsets[1:][:2]))
    scenario("closure", lambda: kept(c2, lambda d: (lambda n=d.num_tokens_per_expert: n)()))
    scenario("handle", via_handle)
    scenario("y", combined)
    scenario("sync_free", sync_free)
    scenario("refused", refused)
    gc.collect()  # the kept exception's traceback holds its frames, whose locals hold the exception: a cycle
    autograd()
    # T > max_tokens_per_rank on rank 0: refused everywhere
    big = (torch.zeros(9, CFG["H"], dtype=torch.bfloat16), torch.zeros(9, CFG["K"], dtype=torch.int64),
           torch.ones(9, CFG["K"]))
    try:
        buf.dispatch(*(big if rank == 0 else c2))
        out["capacity"] = "none"
    except (CapacityError, PeerInputError) as e:
        out["capacity"] = type(e).__name__
    churn()
    # an in-place op on a differentiable combine output (a residual add), EPBuffer.combine and the op
    from tritonep.ep import ops  # imported in the rank (the kernels must load under the interpreter)

    x = c0[0].clone().requires_grad_(True)
    for name, fwd in (("inplace", lambda: buf.combine(expert(d.x) * 1.0, d.handle)),
                      ("inplace_op", lambda: ops.combine(expert(d.x) * 1.0, d))):
        d = buf.dispatch(x, c0[1], c0[2]) if name == "inplace" else ops.dispatch(ops.buffer_id(buf), x, c0[1], c0[2])
        y = fwd()
        if geometry:  # decode: y is pooled
            pooled[name] = _pooled(buf, y)
        try:
            y.add_(1.0)
            out[name] = "ok"
        except RuntimeError as e:
            out[name] = str(e)[:80]
        del d, y
    buf.close()
    out["pool_bytes_after_close"] = backend_of(buf).output_pool_bytes
    return out, pooled


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
    for rank, (got, pooled) in enumerate(run_cpu_world(2, _world, geometry, "1", calls, timeout_s=300)):
        not_pooled = [k for k, v in pooled.items() if not v]
        assert not not_pooled, f"rank {rank}: these scenarios did not get the pool's set: {not_pooled}"
        assert got["inplace"] == got["inplace_op"] == "ok", f"rank {rank}: {got['inplace']} / {got['inplace_op']}"
        assert got["capacity"] != "none" and got["refused"][0] in ("InputError", "PeerInputError")
        assert got["pool_bytes_after_close"] == 0, "close kept the pool's blocks"
        for name, v in got.items():
            if isinstance(v, tuple):  # (read at once, read after later calls)
                _equal(v[0], v[1], f"rank {rank}: {name}")
