"""One rank failing between dispatch and combine: no call returns a value computed without a peer's data, no rank
waits for nothing, and the buffer stays usable (or the error says to rebuild it, and rebuilding works).

A rank whose combine input is refused (wrong dtype, too few rows, another buffer's handle) or whose own code failed
between dispatch and combine (it calls ``EPBuffer.cancel_combine``; the MoE layer does so itself) still takes part in
the combine as refused (host protocol rule). In an eager call every peer's combine raises PeerInputError naming it;
sync-free, every peer's output is NaN and the next ``check()`` raises on every rank (the refused rank too). Before,
the peers waited ``timeout_s`` and returned a wrong ``y`` without raising (triton) or hung (nccl). A rank that simply
skips its combine makes its peers time out: PeerTimeoutError in an eager combine, NaN and a refused next call
otherwise (never the stale rows a timed-out rank's skipped sends left), then every rank rebuilds its buffer.
"""

import time

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import ConfigError, InputError, PeerTimeoutError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import check_grads, run_grad_call, set_env
from tests.support.outcomes import timeout_verdict, verdict

H, TM, K = 64, 8, 2
GEOMETRIES = {"two_kernel": "dec=0,fs=0,fe=0,fc=0", "fused": "fs=1,fe=1,fc=1", "decode": "bt=2,dec=2"}


def _buffer(group, backend, geometry, **kw):
    set_env(TRITONEP_GEOMETRY=GEOMETRIES[geometry])
    try:
        return tep.EPBuffer(group, 2 * dist.get_world_size(group), H, TM, K, backend=backend, **kw)
    finally:
        set_env(TRITONEP_GEOMETRY=None)


def _inputs(rank, W, seed):
    return make_rank_inputs(rank, 6, H, 2 * W, K, seed=seed, mask_frac=0.0)  # 12 routes: rows on every rank


def _nan_kind(y):
    """What a combine output shows: "all NaN" / "some NaN" / "finite" (None: the call returned nothing)."""
    if y is None:
        return None
    return "all NaN" if y.numel() and bool(torch.isnan(y).all()) else \
        ("some NaN" if bool(torch.isnan(y).any()) else "finite")


def _refusal_world(group, backend, geometry, sync_free, how, bad):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    buf = _buffer(group, backend, geometry, timeout_s=60)
    other = _buffer(group, backend, geometry) if how == "handle" else None
    x, idx, w = (t.to(buf.device) for t in _inputs(rank, W, 1))  # CPU worlds and GPU ones
    d = buf.dispatch(x, idx, w, sync_free=sync_free)
    d2 = other.dispatch(x, idx, w) if other is not None else None
    eo = (d.x.float() * 0.5).to(torch.bfloat16)

    def step():
        if rank not in bad:
            return buf.combine(eo, d.handle)
        if how == "dtype":
            return buf.combine(eo.float(), d.handle)
        if how == "rows":
            return buf.combine(eo[:-1], d.handle)
        if how == "handle":
            return buf.combine(eo, d2.handle)
        try:  # "cancel": this rank's own code fails between dispatch and combine
            raise RuntimeError("expert failed")
        except RuntimeError:
            buf.cancel_combine(d.handle if how == "cancel" else None)
        return None

    out = dict(combine=verdict(lambda: _nan_kind(step()), InputError, ConfigError), check=verdict(buf.check),
               check_again=verdict(buf.check))
    if other is not None:
        other.combine(d2.x.clone(), d2.handle)  # the other buffer's own combine, on every rank
        other.close()
    out["geometry"] = None if buf.geometry is None else (buf.geometry.decode, buf.geometry.fused_combine)
    out["good"] = [run_grad_call(buf, *_inputs(rank, W, s), grad_seed=s, bias=1.0) for s in (2, 3)]
    buf.check()
    buf.close()
    return out


def _assert_refused(res, geometry, sync_free, how, bad):
    W = len(res)
    for r, out in enumerate(res):
        own = {"dtype": "InputError", "rows": "InputError", "handle": "ConfigError"}.get(how)
        if r in bad:
            assert (out["combine"][0] == own) if own else (out["combine"] == ("ok", None)), (r, out["combine"])
        elif sync_free:
            assert out["combine"] == ("ok", "all NaN"), (r, out["combine"])  # cannot pass for a result
        else:
            assert out["combine"] == ("PeerInputError", sorted(bad)), (r, out["combine"])
        # sync-free: the next read raises on every rank, the refused one included; eager: already raised
        assert out["check"] == (("PeerInputError", sorted(bad)) if sync_free else ("ok", None)), (r, out["check"])
        assert out["check_again"] == ("ok", None), (r, out)
    if res[0]["geometry"] is not None:  # triton: the geometry the case names really ran (decode, fused combine)
        dec, fc = res[0]["geometry"]
        assert (dec > 0, bool(fc)) == (geometry == "decode", geometry == "fused"), (geometry, res[0]["geometry"])
    for i in range(2):
        check_grads(2 * W, [out["good"][i] for out in res], where=f"after the refusal, call {i}")


CASES = [  # W, backend, geometry, sync_free, how, bad ranks
    (2, "triton", "two_kernel", False, "dtype", [1]),
    (2, "triton", "decode", True, "cancel", [1]),
    (3, "nccl", "two_kernel", False, "rows", [0]),
    (2, "nccl", "two_kernel", True, "handle", [1]),
]
SLOW_CASES = [
    (3, "triton", "decode", True, "cancel", [2]),
    (3, "triton", "two_kernel", True, "rows", [1]), (2, "triton", "fused", False, "handle", [0]),
    (3, "triton", "fused", True, "dtype", [2]), (2, "triton", "decode", False, "cancel", [1]),
    (2, "triton", "two_kernel", False, "cancel_last", [0]), (2, "nccl", "two_kernel", False, "cancel", [1]),
    (3, "nccl", "two_kernel", True, "dtype", [1]),
    # two ranks refuse the same call
    (3, "triton", "two_kernel", False, "dtype", [1, 2]), (3, "nccl", "two_kernel", True, "cancel", [0, 2]),
    (3, "triton", "decode", False, "rows", [0, 1]),
]


@pytest.mark.parametrize("W,backend,geometry,sync_free,how,bad", CASES)
def test_refused_or_cancelled_combine_fails_on_every_rank(W, backend, geometry, sync_free, how, bad):
    res = run_cpu_world(W, _refusal_world, backend, geometry, sync_free, how, bad, timeout_s=300)
    _assert_refused(res, geometry, sync_free, how, bad)


@pytest.mark.slow
@pytest.mark.parametrize("W,backend,geometry,sync_free,how,bad", SLOW_CASES)
def test_refused_or_cancelled_combine_every_path(W, backend, geometry, sync_free, how, bad):
    res = run_cpu_world(W, _refusal_world, backend, geometry, sync_free, how, bad, timeout_s=300)
    _assert_refused(res, geometry, sync_free, how, bad)


# ------------------------------------------------------------------------------------------------ a skipped combine
def _skip_world(group, geometry, sync_free):
    """The last rank skips its combine without cancelling (its code raised and nobody told the buffer): the peers'
    combine gives up after timeout_s; the last rank's next dispatch must not pair with stale rows. Then every rank
    rebuilds its buffer and the new one is exact."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    buf = _buffer(group, "triton", geometry, timeout_s=4)
    x, idx, w = _inputs(rank, W, 1)
    d = buf.dispatch(x, idx, w, sync_free=sync_free)
    out = {}
    if rank != W - 1:
        got = timeout_verdict(lambda: _nan_kind(buf.combine(d.x.clone(), d.handle)))
        out["combine"] = got if got[0] == "ok" else (got[0], "build a new EPBuffer" in got[-1])
    else:
        out["combine"] = ("skipped",)
        time.sleep(2.0)  # the peers' combine is still waiting; this rank's next call comes before they give up
    out["next"] = verdict(lambda: buf.dispatch(x, idx, w) and None, PeerTimeoutError, tep.errors.BufferStateError,
                          message=False)
    buf.close()
    buf = _buffer(group, "triton", geometry, timeout_s=60)  # rebuilt on every rank
    out["good"] = run_grad_call(buf, *_inputs(rank, W, 5), grad_seed=5, bias=1.0)
    buf.check()
    buf.close()
    return out


@pytest.mark.slow  # waits that must time out (4 s each)
@pytest.mark.parametrize("W,geometry,sync_free", [(2, "two_kernel", False), (3, "decode", True),
                                                  (2, "fused", True)])
def test_a_skipped_combine_times_out_and_rebuilding_works(W, geometry, sync_free):
    res = run_cpu_world(W, _skip_world, geometry, sync_free, timeout_s=300, check_protocol=False)  # one skips
    for r, out in enumerate(res[:-1]):
        if sync_free:
            assert out["combine"] == ("ok", "all NaN"), out  # never the partial sums of the peers that came
            assert out["next"] == ("PeerTimeoutError",), out  # the next read raises the recorded timeout
        else:
            assert out["combine"] == ("PeerTimeoutError", True), out  # and the message says to rebuild
            assert out["next"] == ("BufferStateError",), out
    # the skipping rank's next dispatch never returns rows its timed-out peers did not send: refused or timed out
    assert res[-1]["next"][0] in ("PeerInputError", "PeerTimeoutError"), res[-1]
    check_grads(2 * len(res), [out["good"] for out in res], where="rebuilt buffer")


# ------------------------------------------------------------------------------------------------ MoE layer
def _moe_world(group, backend, sync_free):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    geo = tep.MoEGeometry(hidden=H, intermediate=32, num_experts=2 * W, topk=K, max_tokens_per_rank=TM)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=sync_free), geo, group, seed=2, backend=backend)
    x, idx, w = _inputs(rank, W, 1)
    if rank == 1:  # this rank's experts fail (e.g. out of memory) between its dispatch and its combine
        import tritonep.moe.layer as mod

        orig = mod.expert_ffn_parts_forward

        def boom(*a, **k):
            raise RuntimeError("experts ran out of memory")

        mod.expert_ffn_parts_forward = boom
    first = verdict(lambda: _nan_kind(layer(x, idx, w)), RuntimeError)
    if rank == 1:
        mod.expert_ffn_parts_forward = orig
    check = verdict(layer.buffer.check, RuntimeError)  # sync-free: the failing rank's own error, deferred to it
    y2 = layer(x, idx, w).detach().clone()
    layer.buffer.check()
    layer.close()
    return first, check, y2, (x, idx, w)


@pytest.mark.parametrize("W,backend,sync_free", [pytest.param(2, "triton", False, marks=pytest.mark.slow),
                                                 (3, "nccl", True)])
def test_moe_layer_cancels_the_combine_when_its_experts_fail(W, backend, sync_free):
    from tritonep.reference import moe_dense_reference

    res = run_cpu_world(W, _moe_world, backend, sync_free, timeout_s=300)
    geo = tep.MoEGeometry(hidden=H, intermediate=32, num_experts=2 * W, topk=K, max_tokens_per_rank=TM)
    w1, w2 = tep.MoELayer.init_expert_weights(geo, seed=2)
    for r, (first, check, y2, inp) in enumerate(res):
        if not sync_free:  # eager: every rank raises in the step (the failing rank its experts' error)
            assert first == (("RuntimeError", "experts ran out of memory") if r == 1 else ("PeerInputError", [1])), \
                (r, first)
            assert check == ("ok", None), (r, check)
        else:  # sync-free: no rank raises in the step (NaN everywhere); every check() raises, the failing rank its
            assert first == ("ok", "all NaN"), (r, first)  # own error (tests/moe/test_sync_free_failed_experts.py)
            assert check == (("RuntimeError", "experts ran out of memory") if r == 1 else ("PeerInputError", [1])), \
                (r, check)
        ref = moe_dense_reference(*inp, w1, w2)
        assert torch.allclose(y2.float(), ref, rtol=2 ** -5, atol=2 ** -5), r  # the layer works on
