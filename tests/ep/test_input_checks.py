"""Bad inputs are named before any peer is touched: a typed error naming the value (dtype, shape, id, top-k, an
expert id == E from an appended shared-expert column, a non-bf16 buffer, a handle of another buffer) and the
buffer stays usable; non-contiguous inputs give the contiguous result. The backward halves the MoE layer chains
outside autograd (dispatch_backward / combine_backward) check their inputs like combine does; every rank passes the
same bad input there, so no rank waits for another."""


import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import ConfigError, InputError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, check_calls, diff, run_call


def _bad_backward_world(group, backend):
    rank = dist.get_rank(group)
    E, H, Tm, K = 4, 64, 8, 2
    buf = tep.EPBuffer(group, E, H, Tm, K, backend=backend)
    other = tep.EPBuffer(group, E, H, Tm, K, backend=backend)
    x, idx, w = make_rank_inputs(rank, 6, H, E, K, seed=3)
    d = buf.dispatch(x, idx, w)
    R = d.x.shape[0]
    eo = d.x.clone()
    gy = torch.ones(6, H, dtype=BF16)
    cases = {
        "combine_backward grad_y float32": lambda: buf.combine_backward(gy.float(), eo, d.handle),
        "combine_backward grad_y narrow": lambda: buf.combine_backward(gy[:, :32], eo, d.handle),
        "combine_backward grad_y rows": lambda: buf.combine_backward(gy[:5], eo, d.handle),
        "combine_backward expert_out float32": lambda: buf.combine_backward(gy, eo.float(), d.handle),
        "combine_backward foreign handle": lambda: other.combine_backward(gy, eo, d.handle),
        "dispatch_backward grad_x float32": lambda: buf.dispatch_backward(eo.float(), None, d.handle),
        "dispatch_backward grad_x narrow": lambda: buf.dispatch_backward(eo[:, :32], None, d.handle),
        "dispatch_backward grad_w float16": lambda: buf.dispatch_backward(eo, torch.ones(R, dtype=torch.float16),
                                                                          d.handle),
        "dispatch_backward grad_w short": lambda: buf.dispatch_backward(eo, torch.ones(max(R - 1, 0)), d.handle)
        if R else buf.dispatch_backward(eo, torch.ones(1, 1), d.handle),
        "dispatch_backward foreign handle": lambda: other.dispatch_backward(eo, None, d.handle),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "accepted"
        except (tep.InputError, tep.ConfigError) as e:
            out[name] = type(e).__name__
    # the good calls still work afterwards (no launch was made by a refused call)
    g_eo, g_w = buf.combine_backward(gy, eo, d.handle)
    g_x, g_tw = buf.dispatch_backward(g_eo, g_w, d.handle)
    out["good"] = (tuple(g_x.shape), tuple(g_tw.shape))
    other.close()
    buf.close()
    return out


def test_backward_halves_refuse_bad_inputs():
    for backend in ("triton", "nccl"):
        res = run_cpu_world(2, _bad_backward_world, backend, timeout_s=300)
        for r, out in enumerate(res):
            assert out.pop("good") == ((6, 64), (6, 2))
            accepted = [k for k, v in out.items() if v == "accepted"]
            assert not accepted, (backend, r, accepted)
            assert all(v == "ConfigError" for k, v in out.items() if "foreign" in k), out


def _dtype_refused_world(group, dtype, backend):
    try:
        tep.EPBuffer(group, 4, 64, 4, 1, dtype=dtype, backend=backend)
        return "no error"
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_bf16_dtype_is_refused(dtype, backend):
    # was: float32/float16 accepted and silently rounded through bf16 rows (triton backend); now refused by name
    for msg in run_cpu_world(2, _dtype_refused_world, dtype, backend, timeout_s=60):
        assert f"dtype={dtype}" in msg and "bfloat16" in msg


def _foreign_handle_world(group):
    rank = dist.get_rank(group)
    a = tep.EPBuffer(group, 4, 64, 8, 2)
    b = tep.EPBuffer(group, 8, 64, 8, 2)  # differs only in num_experts
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    d = a.dispatch(x, idx, w)
    try:
        b.combine(d.x, d.handle)
        out = "no error"
    except ConfigError as e:
        out = str(e)
    b.close()
    a.close()
    return out


def test_handle_from_another_buffer_is_refused():
    for msg in run_cpu_world(2, _foreign_handle_world, timeout_s=60):
        assert msg != "no error"


def _bad_input_world(group):
    buf = tep.EPBuffer(group, 8, 64, 8, 2)
    x = torch.randn(4, 64).bfloat16()
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    w = torch.ones(4, 2)
    errs = {}
    cases = {
        "dtype": (x.float(), idx, w),
        "shape": (x[:, :32], idx, w),
        "idx_dtype": (x, idx.float(), w),
        "topk": (x, idx[:, :1], w[:, :1]),
        "id_high": (x, torch.tensor([[0, 1], [2, 3], [4, 8], [6, 7]]), w),
        "id_low": (x, torch.tensor([[0, -2], [2, 3], [4, 5], [6, 7]]), w),
    }
    for name, args in cases.items():
        try:
            buf.dispatch(*args)
            errs[name] = None
        except InputError as e:
            errs[name] = str(e)
    # a transposed (non-contiguous) view gives the same result as the contiguous tensor
    xt = x.t().contiguous().t()
    a = buf.dispatch(x, idx, w).x.clone()
    b = buf.dispatch(xt, idx, w).x.clone()
    buf.close()
    return errs, torch.equal(a, b), xt.is_contiguous()


def test_bad_inputs_are_named_before_any_peer_is_touched():
    res = run_cpu_world(2, _bad_input_world, timeout_s=120)
    for errs, same, contig in res:
        assert not contig and same
        assert "bfloat16" in errs["dtype"]
        assert "hidden=64" in errs["shape"]
        assert "int32 or int64" in errs["idx_dtype"]
        assert "topk=2" in errs["topk"]
        assert "topk_idx[2, 1] = 8" in errs["id_high"]
        assert "topk_idx[0, 1] = -2" in errs["id_low"]


def _shared_column_world(group, backend):
    rank = dist.get_rank(group)
    E, K = 256, 4
    buf = tep.EPBuffer(group, E, 64, 4, K, backend=backend)
    x, idx, w = make_rank_inputs(rank, 3, 64, E, K - 1, seed=2)
    idx_shared = torch.cat([idx, torch.full((3, 1), E, dtype=idx.dtype)], 1)  # the shared expert as id E
    w4 = torch.cat([w, torch.ones(3, 1)], 1)
    try:
        buf.dispatch(x, idx_shared, w4)
        err = None
    except InputError as e:
        err = str(e)
    # nothing was touched: the next valid call works
    ok = (x, torch.cat([idx, torch.full((3, 1), -1, dtype=idx.dtype)], 1), w4)
    rec = run_call(buf, *ok, out_buffer=False)
    buf.close()
    return err, ok, rec


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_shared_expert_column_is_named(backend):
    res = run_cpu_world(2, _shared_column_world, backend, timeout_s=120)
    for err, _, _ in res:
        assert err is not None and "topk_idx[0, 3] = 256" in err and "num_experts=256" in err, err
    check_calls(dict(E=256), [[ok] for _, ok, _ in res], [[rec] for _, _, rec in res])


def _noncontig_world(group, backend):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, 64, 8, 3, backend=backend)
    x, idx, w = make_rank_inputs(rank, 7, 64, 8, 3, seed=8)
    wide = torch.stack([x, torch.zeros_like(x)], 2).reshape(7, 128)  # x == wide[:, ::2], a strided view
    views = (wide[:, ::2], idx.t().contiguous().t(), w.t().contiguous().t())
    assert not any(v.is_contiguous() for v in views)
    outs = [run_call(buf, *args, out_buffer=False) for args in ((x, idx, w), views)]
    buf.close()
    return outs


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_non_contiguous_inputs_equal_contiguous(backend):
    for r, (a, b) in enumerate(run_cpu_world(2, _noncontig_world, backend, timeout_s=120)):
        assert diff(b, a) == [], f"rank {r}: non-contiguous inputs changed the result"


def test_script_bad_rank_with_no_tokens_is_refused_at_the_front_door():
    """A refused step whose bad rank has no token (:func:`tests.support.harness.script_world`: its topk_idx is
    ``[0, K + 1]``): that rank raises InputError naming the shape, its peer PeerInputError naming it; then a good
    call, and a bad id found on the device with the other rank empty."""
    from tests.support.harness import check_script, script_world

    cfg = dict(E=8, H=32, Tmax=8, K=2, A=1)
    steps = [("bad", 1, [0, 3], 0), ("ok", 2, [3, 2], None), ("bad", 3, [0, 4], 1)]
    res = run_cpu_world(2, script_world, cfg, steps, timeout_s=300)
    check_script(cfg, steps, res)
