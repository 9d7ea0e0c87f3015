"""The output pool of the nccl backend's sync-free dispatch (:mod:`tritonep.runtime.pool`): a call without
autograd takes its outputs (rows, row weights, counts, offsets and the handle's tensors) from a pooled set once the
caller let the previous call's go, so an inference loop allocates nothing per call. What must hold, in both modes
(``gather``, ``onehop``), on the twins and on the kernels (interpreter), W = 2:

* a caller that keeps a call's outputs never sees them change: the next call gets another set (no shared storage),
  and the kept outputs stay bit-equal to their snapshot through later calls and a combine on them;
* with every set held (2 slots) a call allocates its own outputs, equally right;
* a released set is reused (the same storage comes back) and the reused call's real rows, weights, counts and
  offsets equal a synced dispatch of the same input, its tail weights zero, its combine equal the synced combine;
* a call with autograd takes a pooled set, gets its gradients, and no autograd mark stays on a pooled tensor (the
  rows and row weights are handed out as aliases: autograd marks what a Function returns), through EPBuffer and
  through the ``tritonep::dispatch`` / ``combine`` ops; nor does the mark of an in-place op with a differentiable
  operand on the outputs of a call without autograd;
* a caller that keeps only a handle field (``handle.counts``, ``pkt``, ``recv_rows``, ...) keeps the set: the next
  call does not overwrite it.
"""

import gc
import os

import pytest
import torch
import torch.distributed as dist

from tritonep.ep import EPBuffer
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of

E, H, K, TM = 8, 64, 3, 6


def _snap(d):
    R = int(d.expert_offsets[-1])
    return dict(R=R, x=d.x[:R].clone(), w=d.weights.clone(), ntpe=d.num_tokens_per_expert.clone(),
                offs=d.expert_offsets.clone(), pkt=d.handle.pkt.clone(), rr=d.handle.recv_rows.clone(),
                idx=d.handle.topk_idx.clone(), counts=d.handle.counts.clone())


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a if k != "R") and a["R"] == b["R"]


def _world(group, mode, ut):
    os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode
    os.environ["TRITONEP_OUTPUT_POOL"] = "2"  # 2 sets per stream: the third held call allocates
    rank = dist.get_rank(group)
    buf = EPBuffer(group, E, H, TM, K, backend="nccl", device="cpu")
    backend_of(buf).use_triton = ut
    ins = [make_rank_inputs(rank, 5 + rank, H, E, K, seed=s, mask_frac=0.25) for s in (1, 2)]
    ins = [(x, idx, w.float()) for x, idx, w in ins]
    ref = []
    for x, idx, w in ins:  # the synced dispatch + combine of each input (the oracle)
        d = buf.dispatch(x, idx, w)
        eo = (d.x.float() * 0.5).to(torch.bfloat16)
        ref.append((d.x.clone(), d.weights.clone(), d.num_tokens_per_expert.clone(), d.expert_offsets.clone(),
                    buf.combine(eo, d.handle).clone()))
    bad = []

    def check(d, i, what):
        R = int(d.expert_offsets[-1])
        rx, rw, rn, ro, ry = ref[i]
        ok = (torch.equal(d.x[:R], rx) and torch.equal(d.weights[:R], rw) and not d.weights[R:].any()
              and torch.equal(d.num_tokens_per_expert, rn) and torch.equal(d.expert_offsets, ro))
        y = buf.combine((d.x.float() * 0.5).to(torch.bfloat16), d.handle)
        if not (ok and torch.equal(y, ry)):
            bad.append(f"{what}: outputs differ from the synced dispatch / combine")
        if d.weights.storage_offset() or d.x.storage_offset():  # what the tritonep::dispatch op's fake promises
            bad.append(f"{what}: rows / row weights not at storage offset 0")

    d1 = buf.dispatch(*ins[0], sync_free=True)
    s1, p1 = _snap(d1), d1.x.data_ptr()
    d2 = buf.dispatch(*ins[1], sync_free=True)  # d1 held: another set
    if d2.x.data_ptr() == p1 or d2.weights.data_ptr() == d1.weights.data_ptr() or \
            d2.handle.pkt.data_ptr() == d1.handle.pkt.data_ptr():
        bad.append("a held call's outputs were handed out again")
    check(d2, 1, "second call (first held)")
    if not _same(_snap(d1), s1):
        bad.append("a held call's outputs changed under the next call")
    check(d1, 0, "held first call")
    d6 = buf.dispatch(*ins[1], sync_free=True)  # both sets held (2 slots): allocated, not pooled, still right
    held = {t.untyped_storage().data_ptr() for p in backend_of(buf)._sync_free._sf_pools.values() for ss in p._sets.values()
            for st in ss for t in st.objs}  # addresses only: a list of the pooled tensors would hold every set
    if {d6.x.untyped_storage().data_ptr(), d6.handle.pkt.untyped_storage().data_ptr()} & \
            (held | {d1.x.untyped_storage().data_ptr(), d2.x.untyped_storage().data_ptr()}):
        bad.append("a call with every set held shared a pooled set's storage")
    check(d6, 1, "every set held")
    del d1, d6
    d3 = buf.dispatch(*ins[1], sync_free=True)  # the first set is free again: reused
    if d3.x.data_ptr() != p1:
        bad.append("a released set was not reused")
    check(d3, 1, "reused set")
    del d2, d3
    # autograd: the gradients flow (the row weights handed out are the handle's), and no mark of the autograd
    # graph stays on a pooled tensor (the next call without autograd gets plain tensors)
    gc.collect()  # (an autograd call leaves a reference cycle: its handle holds the tracked row weights, whose
    # backward node holds the handle; its set stays held until the cyclic collector runs)
    impl = backend_of(buf)

    def pools():
        return [impl._sync_free._sf_rpool, *impl._sync_free._sf_pools.values()]

    def unmarked(d, what):
        """No autograd mark on any pooled tensor nor on ``d``'s outputs, and no set dropped since ``sets0`` (the
        aliases keep marks off the pooled tensors, so the pool never has to drop a marked set: pool.py
        _Set.marked)."""
        objs = [t for p in pools() for ss in p._sets.values() for st in ss for t in st.objs]
        if any(t.requires_grad or t.grad_fn is not None for t in objs) or d.x.requires_grad or d.weights.requires_grad:
            bad.append(what)
        if not sets0 <= {id(st) for p in pools() for ss in p._sets.values() for st in ss}:
            bad.append(what + ": a pooled set was dropped")

    sets0 = {id(st) for p in pools() for ss in p._sets.values() for st in ss}
    xg, wg = ins[0][0].clone().requires_grad_(True), ins[0][2].clone().requires_grad_(True)
    d4 = buf.dispatch(xg, ins[0][1], wg, sync_free=True)
    pooled = {t.untyped_storage().data_ptr() for p in [impl._sync_free._sf_rpool, *impl._sync_free._sf_pools.values()]
              for ss in p._sets.values() for st in ss for t in st.objs}
    if not {d4.x.untyped_storage().data_ptr(), d4.weights.untyped_storage().data_ptr()} <= pooled:
        bad.append("the autograd call did not take pooled outputs")
    y = buf.combine((d4.x.float() * 0.5).to(torch.bfloat16), d4.handle)
    y.float().sum().backward()
    if xg.grad is None or wg.grad is None or not torch.equal(y, ref[0][4]):
        bad.append("autograd through a pooled call: no gradient or a wrong combine")
    del d4, y
    gc.collect()
    d5 = buf.dispatch(*ins[0], sync_free=True)
    unmarked(d5, "an autograd mark stayed on a pooled tensor")
    check(d5, 0, "after an autograd call")
    del d5
    # an in-place op with a differentiable operand on a call's outputs (no autograd in the call itself): the mark is
    # the alias's, never the pooled tensor's
    scale = torch.ones(H, requires_grad=True)
    d8 = buf.dispatch(*ins[0], sync_free=True)
    d8.x.mul_(scale.to(torch.bfloat16))
    d8.weights.mul_(scale[:1])
    del d8
    d9 = buf.dispatch(*ins[0], sync_free=True)
    unmarked(d9, "an in-place op's autograd mark stayed on a pooled tensor")
    check(d9, 0, "after an in-place op with a differentiable operand")
    # a caller that keeps only handle fields keeps the set (each is counted), also the ones no call returns
    kept = {n: getattr(d9.handle, n) for n in ("counts", "pkt", "recv_rows", "recv_w", "topk_weights")}
    snap = {n: t.clone() for n, t in kept.items()}
    del d9
    for _ in range(3):  # every set of the pool, with another input
        d10 = buf.dispatch(*ins[1], sync_free=True)
        check(d10, 1, "while handle fields of an earlier call are kept")
        del d10
    for n, t in kept.items():
        if not torch.equal(t, snap[n]):
            bad.append(f"a kept handle field ({n}) was overwritten by a later call")
    del kept, snap
    # the same through the ``tritonep::dispatch`` / ``combine`` ops (what the torchtitan adapter calls): the op's
    # own autograd marks what it returns, so it too must hand out aliases of the pooled rows and row weights
    from tritonep.ep.ops import buffer_id

    bid = buffer_id(buf)
    gc.collect()
    xg, wg = ins[0][0].clone().requires_grad_(True), ins[0][2].clone().requires_grad_(True)
    rx, rw_, pair, ticket = torch.ops.tritonep.dispatch(xg, ins[0][1], wg, bid, True)
    if not {rx.untyped_storage().data_ptr(), rw_.untyped_storage().data_ptr()} <= pooled:
        bad.append("the op's autograd call did not take pooled outputs")
    y = torch.ops.tritonep.combine((rx.float() * 0.5).to(torch.bfloat16), rw_, ticket, bid, xg.shape[0])
    y.float().sum().backward()
    if xg.grad is None or wg.grad is None or not torch.equal(y, ref[0][4]):
        bad.append("autograd through the ops on a pooled call: no gradient or a wrong combine")
    del rx, rw_, pair, ticket, y
    gc.collect()
    d7 = buf.dispatch(*ins[0], sync_free=True)
    objs = [t for p in [impl._sync_free._sf_rpool, *impl._sync_free._sf_pools.values()] for ss in p._sets.values() for st in ss
            for t in st.objs]
    if any(t.requires_grad or t.grad_fn is not None for t in objs):
        bad.append("an autograd mark of the ops stayed on a pooled tensor")
    del objs
    check(d7, 0, "after the ops' autograd call")
    buf.check()
    buf.close()
    return bad


@pytest.mark.parametrize("ut", [False, True], ids=["twins", "kernels"])
@pytest.mark.parametrize("mode", ["gather", "onehop"])
def test_pooled_sync_free_outputs(mode, ut):
    res = run_cpu_world(2, _world, mode, ut, timeout_s=240)
    assert res == [[], []], res
