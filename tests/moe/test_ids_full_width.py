"""Expert ids are checked at full width on every path, and the MoE layer reads every status word.

With ``balance="virtual"`` an int64 id of 2**32 + 1 or -(2**32) + 2 used to be served silently by expert 1 or 2:
the planner's histogram and route remap and the triton counts exchange's histogram loaded ids as int32 (the
exchange flagged the id in a status word the layer never read). Now every kernel range-checks ids at their own
width before any cast, and the layer reads the status words of its counts exchange, planner and weight transport
in the one host read it makes per step. Refused ids fail the call on every rank as ``balance="none"`` does: the bad
rank raises ``InputError`` naming the value and ``(token, k)``, the others ``PeerInputError`` naming the bad rank,
no weight is pushed, and the next call works (bit-equal to the same call before the refusal).

Cases (CPU worlds, real kernels in the interpreter):

* the MoE layer, ``balance`` none and virtual, on the triton and nccl backends, ids 2**32 + 1 and -(2**32) + 2;
* the planner on its own (one process): the id becomes ``2E`` with the bad-id status bit, never a valid expert;
* each backend's counts exchange on its own: the id is not counted, and every rank's ``check`` names the bad rank;
* the one-launch decode dispatch (``TRITONEP_GEOMETRY=dec=1``, an EPBuffer alone), which also truncated first;
* found ourselves: a non-contiguous int64 view holding 2**32 + E - 1 (the top valid id in its low bits), in an odd
  world of three ranks where another rank routes no token at all (it raises PeerInputError too);
* the planner's limits are a ConfigError when the layer is built (2048 experts > 1024), before any symmetric memory
  is allocated, naming the value and the limit (it used to be a PlanError at every forward);
* status words the layer never read: a counts exchange that gave up (TRITONEP_SYNC_CHECKS=0, a peer that skips the
  forward) raises PeerTimeoutError in that forward, and a weight transport that gave up in a backward raises at the
  next forward (both used to return silently wrong outputs).
"""

import os

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import ConfigError, InputError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.outcomes import timeout_verdict, verdict

H, I, E, K = 64, 32, 4, 2
BAD = (2 ** 32 + 1, -(2 ** 32) + 2)


def _layer(group, balance, backend, timeout_s=60, num_experts=E):
    """A small MoE layer (push combine) of ``num_experts`` experts."""
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    geo = MoEGeometry(hidden=H, intermediate=I, num_experts=num_experts, topk=K, max_tokens_per_rank=8)
    return MoELayer(MoERecipe(balance=balance, combine="push"), geo, group, timeout_s=timeout_s, backend=backend)


def _layer_world(group, backend):
    """Per balance: good call, two refused calls (rank 1 holds a bad id), the good call again."""
    rank = dist.get_rank(group)
    out = {}
    for balance in ("none", "virtual"):
        layer = _layer(group, balance, backend)
        x, _, w = make_rank_inputs(rank, 6, H, E, K, seed=4)
        idx = torch.zeros(6, K, dtype=torch.int64)  # every route to expert 0: a replica must go to rank 1's slot
        idx[:, 1] = -1
        y0 = layer(x, topk_idx=idx, topk_weights=w)
        slots = []
        if layer.transport is not None:
            for k in ("w1", "w2"):
                layer.transport.slots(k).zero_()
            dist.barrier(group)
        res = []
        for bad in BAD:
            bidx = idx.clone()
            if rank == 1:
                bidx[3, 1] = bad
            res.append(verdict(lambda: layer(x, topk_idx=bidx, topk_weights=w).shape, InputError))
        if layer.transport is not None:
            slots = [bool((layer.transport.slots(k) == 0).all()) for k in ("w1", "w2")]
        y1 = layer(x, topk_idx=idx, topk_weights=w)
        out[balance] = dict(errs=res, slots_untouched=slots, same=torch.equal(y0, y1))
        layer.close()
    return out


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_layer_refuses_64_bit_ids_on_every_rank(backend):
    res = run_cpu_world(2, _layer_world, backend, timeout_s=300)
    for balance in ("none", "virtual"):
        for bad, (e0, e1) in zip(BAD, zip(res[0][balance]["errs"], res[1][balance]["errs"])):
            assert e0 == ("PeerInputError", [1]), (balance, bad, e0)
            assert e1[0] == "InputError" and f"topk_idx[3, 1] = {bad} is outside" in e1[1], (balance, bad, e1)
        for r in range(2):
            assert res[r][balance]["same"], f"{balance}: rank {r}'s next call differs after the refused ones"
            if balance == "virtual":
                assert all(res[r][balance]["slots_untouched"]), f"rank {r}: a refused call pushed weights"


def test_planner_refuses_64_bit_ids_alone():
    from tritonep.balance import place_torch, plan
    from tritonep.errors import PlanError
    from tritonep.device import protocol as P

    topk = torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int64)
    counts = torch.stack([torch.bincount(topk[topk >= 0], minlength=E), torch.tensor([1, 1, 0, 0])])
    for bad, slot in ((2 ** 32 + 1, (1, 1)), (-(2 ** 32) + 2, (0, 0)), (2 ** 32 + E - 1, (2, 0))):
        idx = topk.clone()
        idx[slot] = bad
        c = counts.clone()
        c[0, topk[slot]] -= 1  # the exchange does not count it (it is not a valid expert)
        placement, rt = plan(c, idx, 0)
        assert int(rt[slot]) == 2 * E, (bad, rt)
        assert int(placement.status.max()) & P.v(P.PLAN_BAD_EXPERT_ID), (bad, placement.status)
        assert torch.equal(placement.segment_ends, place_torch(c).segment_ends)
        with pytest.raises(PlanError, match="outside"):
            plan(c, idx, 0, validate=True)


def _counts_world(group, backend):
    import tritonep as tep

    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, 8, K, backend=backend)
    cx = buf.counts_exchange(E)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int64)
    good = cx.gather(idx).clone()
    cx.check()
    bad = idx.clone()
    if rank == 1:
        bad[1, 0] = 2 ** 32 + 2  # low bits: expert 2
    counts = cx.gather(bad).clone()
    err = verdict(cx.check)
    again = cx.gather(idx).clone()
    cx.check()  # the refusal was reported once
    cx.close()
    buf.close()
    return good, counts, err, again


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_counts_exchange_neither_counts_nor_hides_64_bit_ids(backend):
    res = run_cpu_world(2, _counts_world, backend, timeout_s=120)
    for good, counts, err, again in res:
        want = good.clone()
        want[1, 2] -= 1  # rank 1's bad id is not a route to expert 2
        assert torch.equal(counts, want), counts
        assert err == ("PeerInputError", [1]), err
        assert torch.equal(again, good)


def _decode_world(group):
    import tritonep as tep

    rank = dist.get_rank(group)
    os.environ["TRITONEP_GEOMETRY"] = "dec=1"
    buf = tep.EPBuffer(group, E, H, 8, K)
    os.environ.pop("TRITONEP_GEOMETRY")
    x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=6)
    if rank == 0:
        idx[2, 0] = 2 ** 32 + 1
    res = verdict(lambda: buf.dispatch(x, idx, w) and None, InputError)
    d = buf.dispatch(x, idx.clamp(-1, E - 1), w)  # usable afterwards
    buf.close()
    return res, d.num_tokens_per_expert.clone()


def test_decode_dispatch_refuses_64_bit_ids():
    res = run_cpu_world(2, _decode_world, timeout_s=120)
    assert res[0][0][0] == "InputError" and f"= {2 ** 32 + 1} is outside" in res[0][0][1], res[0][0]
    assert res[1][0] == ("PeerInputError", [0]), res[1][0]


def _odd_world(group):
    rank = dist.get_rank(group)
    E3 = 6
    layer = _layer(group, "virtual", "triton", num_experts=E3)
    T = (6, 0, 5)[rank]  # rank 1 routes no token
    x, idx, w = make_rank_inputs(rank, T, H, E3, K, seed=7)
    good = idx
    if rank == 2:
        full = torch.stack([idx, idx], 2).reshape(T, 2 * K).clone()  # the ids as a non-contiguous view
        full[4, 2] = 2 ** 32 + E3 - 1
        idx = full[:, ::2]
        assert not idx.is_contiguous() and int(idx[4, 1]) == 2 ** 32 + E3 - 1
    res = verdict(lambda: layer(x, topk_idx=idx, topk_weights=w).shape, InputError)
    ok = layer(x, topk_idx=good, topk_weights=w)
    layer.close()
    return res, tuple(ok.shape)


def test_non_contiguous_top_id_in_an_odd_world_with_an_empty_rank():
    res = run_cpu_world(3, _odd_world, timeout_s=240)
    assert res[0][0] == res[1][0] == ("PeerInputError", [2]), res
    assert res[2][0][0] == "InputError" and f"topk_idx[4, 1] = {2 ** 32 + 5} is outside" in res[2][0][1], res
    assert [r[1] for r in res] == [(6, H), (0, H), (5, H)]


def _limits_world(group):
    from tritonep.memory import get_heap

    try:
        _layer(group, "virtual", "triton", num_experts=2048)
        err = None
    except ConfigError as e:
        err = str(e)
    return err, get_heap(group, "cpu").used_bytes


def test_planner_limits_are_a_config_error_at_construction():
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    geo = MoEGeometry(hidden=H, intermediate=I, num_experts=2048, topk=K, max_tokens_per_rank=8)
    with pytest.raises(ConfigError, match="num_experts=2048 exceeds the planner limit MAX_PLANNER_EXPERTS=1024"):
        MoELayer.required_bytes(MoERecipe(balance="virtual"), geo, 2, device_type="cpu")
    for err, used in run_cpu_world(2, _limits_world, timeout_s=120):
        assert err is not None and "2048" in err and "1024" in err, err
        assert used == 0, f"{used} bytes of symmetric memory were allocated before the ConfigError"


def _skip_world(group, where):
    rank = dist.get_rank(group)
    os.environ["TRITONEP_SYNC_CHECKS"] = "0"  # the EPBuffer reads nothing: only the layer's own read can raise
    layer = _layer(group, "virtual", "triton", timeout_s=2)
    x, idx, w = make_rank_inputs(rank, 6, H, E, K, seed=8)
    if where == "forward":
        if rank == 1:
            return "skipped"
        return timeout_verdict(lambda: tuple(layer(x, topk_idx=idx, topk_weights=w).shape))
    y = layer(x.requires_grad_(True), topk_idx=idx, topk_weights=w)
    if rank == 0:
        y.float().sum().backward()  # rank 1 skips it: the pull's rendezvous gives up
    return timeout_verdict(lambda: tuple(layer(x.detach(), topk_idx=idx, topk_weights=w).shape))


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_counts_exchange_timeout_is_raised_by_the_layer():
    res = run_cpu_world(2, _skip_world, "forward", timeout_s=120, check_protocol=False)
    assert res[1] == "skipped"
    assert res[0][0] == "PeerTimeoutError", res[0]
    msg = res[0][3]
    assert "counts exchange" in msg and "peer 1" in msg and "after waiting" in msg, msg


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_transport_timeout_in_backward_is_raised_at_the_next_forward():
    res = run_cpu_world(2, _skip_world, "backward", timeout_s=120, check_protocol=False)
    assert res[0][0] == "PeerTimeoutError", res[0]
    msg = res[0][3]
    assert "expert transport" in msg and "peer 1" in msg, msg


def _gpu_ids_world(group):
    """World 1 on one GPU: the counts exchange, the default and the decode dispatch refuse 2**32 + 1."""
    import tritonep as tep

    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for geo in ("", "dec=1"):
        os.environ["TRITONEP_GEOMETRY"] = geo
        buf = tep.EPBuffer(group, E, H, 8, K)
        os.environ.pop("TRITONEP_GEOMETRY")
        x, idx, w = (t.to(dev) for t in make_rank_inputs(0, 5, H, E, K, seed=6))
        bad = idx.clone()
        bad[2, 0] = 2 ** 32 + 1
        cx = buf.counts_exchange(E)
        counts = cx.gather(bad).cpu()
        cerr = verdict(cx.check)
        want = torch.bincount(bad[(bad >= 0) & (bad < E)].cpu(), minlength=E)  # 2**32 + 1 is not counted
        out.append((verdict(lambda: buf.dispatch(x, bad, w) and None, InputError), counts, want, cerr))
        cx.close()
        buf.close()
    return out


@pytest.mark.world1
@pytest.mark.gpu
def test_gpu_64_bit_ids_refused_by_planner_exchange_and_dispatch(gpu_world):
    """On the device: the planner maps 2**32 + 1 to 2E with the bad-id bit; the counts exchange does not count it
    and flags it; the default and the decode dispatch raise InputError naming it."""
    from tritonep.balance import plan
    from tritonep.device import protocol as P
    dev = torch.device("cuda", 0)
    topk = torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int64)
    counts = torch.stack([torch.bincount(topk[topk >= 0], minlength=E), torch.tensor([1, 1, 0, 0])])
    bad = topk.clone()
    bad[1, 1] = 2 ** 32 + 1
    counts[0, 3] -= 1
    placement, rt = plan(counts.to(dev), bad.to(dev), 0)
    assert int(rt[1, 1]) == 2 * E and int(placement.status.max()) & P.v(P.PLAN_BAD_EXPERT_ID), rt
    (rank0,) = gpu_world(1, _gpu_ids_world, timeout_s=600)  # one rank's result: one row per geometry
    for err, counts, want, cerr in rank0:
        assert err[0] == "InputError" and f"= {2 ** 32 + 1} is outside" in err[1], err
        assert torch.equal(counts[0], want.to(counts.dtype)) and cerr == ("PeerInputError", [0]), (counts, want, cerr)
