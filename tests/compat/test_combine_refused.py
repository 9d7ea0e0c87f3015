"""A compat call whose input is refused on one rank still takes part, so no peer waits for it.

docs/deep_ep.md ("Errors"): bad input is refused before any row moves; the refusing rank still takes part with a
flag, so every rank raises and the Buffer stays usable. Checked on the last rank (rank W-1) of worlds of 2 and 3:

- ``combine`` of a synced dispatch (x of the wrong dtype, too few rows, on another device, another Buffer's handle):
  every peer raises PeerInputError naming the rank in the same call (EPBuffer's refused combine);
- ``combine`` of a ``num_worst_tokens`` dispatch with ``topk_weights`` (x of the wrong dtype, or another Buffer's
  handle: then the latest dispatch's lanes stand in; no host read): the peers' output is NaN,
  their combined weights too (on the nccl backend those of the tokens sent to the refusing rank, the others exact),
  and ``Buffer.check()`` raises PeerInputError naming the rank on every rank;
- a cached dispatch with x of the wrong width, a ``num_worst_tokens`` dispatch with float64 weights (no host read:
  the peers get no rows, and go on to the meta lane, where the refusing rank takes part too): the peers' next synced
  dispatch raises PeerInputError;
- ``low_latency_combine`` with x of the wrong shape (EPBuffer's refused dispatch backward:
  ``cancel_dispatch_backward``; NaN on the peers, on the nccl backend for every token with an expert on the refused
  rank, the others exact), ``low_latency_dispatch`` with an argument refused by the Buffer itself, and with x of the
  wrong dtype on the lane's first call or on a new M (the lane is named by the shapes; no rows on the peers):
  ``check()`` raises PeerInputError naming the rank on every rank.

After each, a full round trip gives the right result on every rank. The CPU world checks that every rank ran the
same launches and collectives. The top-k travels as meta rows of the rows lane at these sizes (a combine of
``topk_weights`` dispatches a meta lane first); the meta lane's way (``meta_rows_max_tokens=0``) is checked too.
"""

import pytest
import torch

from tritonep.compat import deep_ep as compat
from tritonep.testing import run_cpu_world
from tests.support.outcomes import verdict

# every wait's bound in these worlds: no test here expects a timeout; on a GPU the ranks' first launches of the
# compat's own kernels compile (seconds) while a peer may already wait
_WAIT_S = 60 if torch.cuda.is_available() else 20


def _verdict(fn):
    """``("ok", None)`` / ``("PeerInputError", ranks)`` / ``(the error's type name,)``: any error is reported (the
    test compares what it got)."""
    return verdict(lambda: fn() and None, Exception, message=False)


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _normal_world(group, backend, how, meta_rows_max_tokens=256):
    """The last rank refuses one normal-mode call (``how``); every rank's outcomes (CPU worlds and GPU ones).
    ``meta_rows_max_tokens``: the Buffers' (0: the top-k in the meta lane; else as meta rows of the rows lane)."""
    rank, W = group.rank(), group.size()
    bad_rank = W - 1
    dev = _device()
    opt = dict(backend=backend, timeout_s=_WAIT_S, meta_rows_max_tokens=meta_rows_max_tokens)
    buf = compat.Buffer(group, 0, 0, **opt)
    other = compat.Buffer(group, 0, 0, **opt)
    E = 2 * W
    x = torch.randn(4, 128, device=dev).bfloat16()
    # every token to two ranks; at W = 3 one token also reaches the last rank (the refusing one)
    idx = torch.tensor([[0, 2], [1, 3], [0, E - 1], [1, 2]], device=dev)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                topk_weights=torch.ones(4, 2, device=dev))
    worst = 64 if how in ("worst", "worst_handle") else 0
    rx, _, rw, _, h, _ = buf.dispatch(x, num_worst_tokens=worst, **args)
    out = {}
    if how == "cached":
        bad = x[:, :64] if rank == bad_rank else x
        out["call"] = _verdict(lambda: buf.dispatch(bad, handle=h))
        out["next"] = _verdict(lambda: buf.dispatch(x, **args))  # synced: reads what the cached call recorded
    elif how == "worst_dispatch":  # float64 weights in a num_worst_tokens dispatch: the peers go on to the meta lane
        bad = dict(args, topk_weights=args["topk_weights"].double()) if rank == bad_rank else args
        res = []
        out["call"] = _verdict(lambda: res.append(buf.dispatch(x, num_worst_tokens=64, **bad)))
        if res:  # no rows on the peers (the call moved none), nothing raised: no host read
            out["no_rows"] = bool((res[0][1] == -1).all())
        out["next"] = _verdict(lambda: buf.dispatch(x, **args))
    else:
        res = []
        weights = rw if how.startswith("worst") else None
        if how in ("handle", "worst_handle"):  # another Buffer's handle (a synced one; this Buffer's dispatch was
            # num_worst_tokens in worst_handle: the peers go on to the meta lane, so does the refusing rank)
            orx, _, _, _, oh, _ = other.dispatch(x, **args)
            bad_h = oh if rank == bad_rank else h
            out["call"] = _verdict(lambda: res.append(buf.combine(rx, bad_h, topk_weights=weights)))
            other.combine(orx, oh)
        else:
            bad = {"dtype": rx.float(), "rows": rx[:-1], "worst": rx.float(), "device": rx.to("meta")}[how]
            out["call"] = _verdict(lambda: res.append(buf.combine(bad if rank == bad_rank else rx, h,
                                                                  topk_weights=weights)))
        if res and weights is not None:  # the output NaN; the combined weights NaN where the backend promises
            # (triton: all of them; nccl: every token sent to the refusing rank, the others exact: weights all 1)
            y, w, _ = res[0]
            hit = itr[:, bad_rank] if backend == "nccl" else torch.ones(4, dtype=torch.bool, device=dev)
            out["nan"] = bool(y.isnan().all()) and bool(w[hit].isnan().all()) and bool((w[~hit] == 1).all())
        out["check"] = _verdict(buf.check)
    rx, _, _, _, h, _ = buf.dispatch(x, **args)  # the Buffer stays usable
    y, _, _ = buf.combine(rx, h)
    out["after"] = torch.equal(y.float(), 2 * x.float())
    other.destroy()
    buf.destroy()
    return out


def _expect(how, rank, W):
    bad_rank = W - 1
    peer, own, ok = ("PeerInputError", [bad_rank]), ("InputError",), ("ok", None)
    if how in ("cached", "worst_dispatch"):  # the refusing rank's own read raises too (triton: InputError, nccl:
        # the PeerInputError naming itself)
        exp = {"call": own if rank == bad_rank else ok, "next": peer, "after": True}
        if how == "worst_dispatch" and rank != bad_rank:
            exp["no_rows"] = True
        return exp
    if how in ("worst", "worst_handle"):  # no host read in that combine: NaN on the peers, check() raises on every rank
        exp = {"call": own, "check": peer, "after": True}
        if rank != bad_rank:
            exp.update(call=ok, nan=True)
        return exp
    return {"call": own if rank == bad_rank else peer, "check": ok, "after": True}


def _own_read(out, how, rank, W):
    """The refusing rank of a cached dispatch: its next synced read raises InputError (triton: its own refused
    input) or the PeerInputError naming itself (nccl)."""
    return how in ("cached", "worst_dispatch") and rank == W - 1 and out == dict(_expect(how, rank, W),
                                                                                 next=("InputError",))


def assert_normal(res, how):
    """Every rank's outcomes of :func:`_normal_world` are the promised ones."""
    W = len(res)
    for r, out in enumerate(res):
        assert out == _expect(how, r, W) or _own_read(out, how, r, W), (r, out)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["dtype", "rows", "device", "handle", "worst", "worst_handle", "cached",
                                 "worst_dispatch"])
def test_refused_normal_call_takes_part(backend, how):
    assert_normal(run_cpu_world(2, _normal_world, backend, how, timeout_s=120), how)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["dtype", "worst", "worst_handle", "cached", "worst_dispatch"])
def test_refused_normal_call_takes_part_meta_lane(backend, how):
    """The same with the top-k in the meta lane (``meta_rows_max_tokens=0``): the refusing rank also takes part in
    the meta lane's calls the peers go on to."""
    assert_normal(run_cpu_world(2, _normal_world, backend, how, 0, timeout_s=120), how)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["dtype", "worst", "cached", "worst_dispatch"])
def test_refused_normal_call_takes_part_world3(backend, how):
    assert_normal(run_cpu_world(3, _normal_world, backend, how, timeout_s=180), how)


def _ll_world(group, backend, how):
    """The last rank refuses one low-latency call (``how``); every rank's outcomes (CPU worlds and GPU ones)."""
    rank, W = group.rank(), group.size()
    bad_rank = W - 1
    dev = _device()
    buf = compat.Buffer(group, 0, 0, low_latency_mode=True, backend=backend, timeout_s=_WAIT_S)
    M, H, E = 4, 128, 2 * W
    x = torch.randn(3, H, device=dev).bfloat16()
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]], device=dev) % E
    w = torch.rand(3, 2, device=dev)
    out = {}
    if how == "dispatch":  # refused by the Buffer before its exchange (DeepEP's argument rule)
        out["call"] = _verdict(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                                async_finish=rank == bad_rank,
                                                                return_recv_hook=rank == bad_rank))
    elif how in ("dtype_first", "dtype_new_m"):  # x float32: refused before its lane is known from the dtypes
        Mc = M
        if how == "dtype_new_m":
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            Mc = 2 * M
        xb = x.float() if rank == bad_rank else x
        out["call"] = _verdict(lambda: buf.low_latency_dispatch(xb, idx, Mc, E, use_fp8=False))
    else:
        rx, count, h, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        bad = rx[:, :-1] if rank == bad_rank else rx
        res = []
        out["call"] = _verdict(lambda: res.append(buf.low_latency_combine(bad, idx, w, h)))
        if res:  # NaN where the backend promises: triton everywhere, nccl every token with an expert on the bad
            # rank (the others exact: every expert returns its rows unchanged, 2 experts per rank)
            y = res[0][0]
            hit = (idx // 2 == bad_rank).any(1) if backend == "nccl" else \
                torch.ones(3, dtype=torch.bool, device=dev)
            ref = (x.float().unsqueeze(1) * w.unsqueeze(2)).sum(1).bfloat16()
            out["nan"] = bool(y[hit].isnan().all()) and torch.equal(y[~hit], ref[~hit])
    out["check"] = _verdict(buf.check)
    rx, count, h, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    y, _, _ = buf.low_latency_combine(rx, idx, w, h)
    ref = (x.float().unsqueeze(1) * w.unsqueeze(2)).sum(1).bfloat16()  # every expert returns its rows unchanged
    out["after"] = torch.equal(y, ref)
    buf.check()
    buf.destroy()
    return out


def assert_ll(res, backend, how):
    """Every rank's outcomes of :func:`_ll_world` are the promised ones."""
    W = len(res)
    for r, out in enumerate(res):
        exp = {"call": ("InputError",), "check": ("PeerInputError", [W - 1]), "after": True}
        if r != W - 1:
            exp["call"] = ("ok", None)
            if how == "combine":
                exp["nan"] = True
        # the refusing rank's own check() names it too, on both backends (its own error was raised at the call)
        assert out == exp, (r, out)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["combine", "dispatch", "dtype_first", "dtype_new_m"])
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_refused_low_latency_call_takes_part(backend, how, W):
    assert_ll(run_cpu_world(W, _ll_world, backend, how, timeout_s=180), backend, how)
