"""dispatch(sync_free=True) on the nccl backend: no host read, ``max_recv_tokens`` rows whose real rows
``[0, expert_offsets[-1])`` equal the synced dispatch's bit for bit (rows, weights (zero past them), counts,
offsets), combine and both backward passes through the sync-free handle equal the synced ones; errors on any rank
are recorded on the device and raised on EVERY rank by the next ``check()`` / synced dispatch, nothing moved.

Both modes (``TRITONEP_NCCL_SYNC_FREE``: ``gather``, ``onehop``; :mod:`tritonep.backends.nccl.sync_free`) run the same
cases (one-hop: the bf16 cases; a quantized wire under the default rule resolves to gather, an explicit one-hop
with it is refused at construction).

CPU worlds (gloo): the torch twins, and (``use_triton``) the Triton kernels in the interpreter. The device plan
kernel against its twin and the host plan in one process.
"""

import os


import numpy as np
import pytest
import torch
import torch.distributed as dist

from tritonep.ep import EPBuffer
from tritonep.errors import CapacityError, ConfigError, InputError, PeerInputError, WireError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of

E, H, K, TM = 8, 128, 3, 6


def _inputs(rank, T, seed, all_masked=False, num_experts=E):
    x, idx, w = make_rank_inputs(rank, T, H, num_experts, K, seed=seed, mask_frac=0.25)
    if T > 2:
        idx[1, -1] = idx[1, 0]  # one expert twice in a token
    if all_masked:
        idx[:] = -1
    return x, idx, w.float()


def _step(buf, x, idx, w, sync_free, kq=False):
    """Dispatch -> expert outputs -> combine -> backward; the real rows of every output (R from the offsets)."""
    xg, wg = x.clone().requires_grad_(not kq), w.clone().requires_grad_(not kq)
    reads = buf.host_reads
    d = buf.dispatch(xg, idx, wg, keep_quantized=kq, sync_free=sync_free)
    got = dict(reads=buf.host_reads - reads)
    R = int(d.expert_offsets[-1]) if d.expert_offsets.numel() else 0
    got.update(R=R, nrows=d.x.shape[0], ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
               x=d.x[:R].detach().clone(), w=d.weights[:R].detach().clone(),
               tail_w=d.weights[R:].detach().clone(), counts=d.handle.counts.clone())
    if kq:
        got["sc"] = d.x_scales[:R].clone()
        return got
    eo = (d.x.float() * 0.5 - 0.25).to(torch.bfloat16)
    eo.retain_grad()
    y = buf.combine(eo, d.handle)
    gy = torch.linspace(-1, 1, y.numel()).view_as(y)
    (y.float() * gy).sum().backward()
    got.update(y=y.detach().clone(), gx=xg.grad.clone(), gw=wg.grad.clone(), geo=eo.grad[:R].clone(),
               geo_tail=eo.grad[R:].clone())
    return got


def _compare(a, b):
    """Names of the fields where the sync-free result ``b`` differs from the synced ``a`` (empty: bit-equal)."""
    skip = ("reads", "nrows", "tail_w", "geo_tail")
    bad = [k for k in a if k not in skip and not (a[k] == b[k] if k == "R" else torch.equal(a[k], b[k]))]
    if b["tail_w"].any():
        bad.append("tail weights not zero")
    if "geo_tail" in b and b["geo_tail"].any():
        bad.append("tail expert-output gradients not zero")
    return bad


MODES = ("gather", "onehop")


def _buffer(group, mode, *args, **kw):
    """An nccl EPBuffer made with TRITONEP_NCCL_SYNC_FREE = ``mode`` (None: unset), the variable restored."""
    old = os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
    if mode is not None:
        os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode
    try:
        return EPBuffer(group, *args, backend="nccl", device="cpu", **kw)
    finally:
        os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
        if old is not None:
            os.environ["TRITONEP_NCCL_SYNC_FREE"] = old


def _equal_world(group, cases, mode="gather"):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for A, wire, ut, Ts, masked, kq in cases:
        if mode == "onehop" and wire != "bf16":
            continue
        buf = _buffer(group, mode, E * W // 2, H, TM, K, expert_alignment=A, dispatch_wire=wire,
                      combine_wire=wire)
        assert backend_of(buf).sync_free_mode == mode, (mode, backend_of(buf).sync_free_mode)
        backend_of(buf).use_triton = ut
        for seed in (1, 2):
            x, idx, w = _inputs(rank, Ts[rank], seed, masked and rank == 0, E * W // 2)
            a = _step(buf, x, idx, w, False, kq)
            b = _step(buf, x, idx, w, True, kq)
            out.append(((A, wire, ut, Ts, masked, kq, seed), _compare(a, b), b["reads"], b["nrows"], a["R"]))
        buf.check()  # nothing recorded
        buf.close()
    return out


CASES_W2 = [
    (1, "bf16", False, (5, 6), False, False),
    (4, "bf16", False, (0, 6), False, False),  # a rank without tokens, padding rows
    (1, "bf16", False, (6, 4), True, False),  # every id of rank 0 masked
    (2, "fp8", False, (6, 3), False, False),  # quantized wires (dispatch and combine)
    (2, "fp8", False, (6, 3), False, True),  # keep_quantized: payload + scales, padding = zero encoding
    (2, "mxfp4", False, (4, 6), False, True),
    (2, "fp8", True, (6, 3), False, True),  # kept rows through the kernels: two sources, zero-row padding
    (1, "fp8", True, (5, 2), False, False),  # dequantized rows, quantized combine, backward (kernels)
    (1, "bf16", True, (5, 6), False, False),  # the Triton kernels (interpreter)
    (3, "bf16", True, (0, 4), False, False),
]


def _check(res, max_recv):
    for per_rank in res:
        for case, bad, reads, nrows, R in per_rank:
            assert not bad, (case, bad)
            assert reads == 0 and nrows == max_recv(case), (case, reads, nrows)


@pytest.mark.parametrize("mode", MODES)
def test_sync_free_equals_synced_w2(mode):
    res = run_cpu_world(2, _equal_world, CASES_W2, mode, timeout_s=150)
    _check(res, lambda c: 2 * TM * min(K, E // 2) + (E // 2) * (c[0] - 1))
    assert any(R > 0 for per_rank in res for *_, R in per_rank)
    assert len(res[0]) == 2 * sum(c[1] == "bf16" or mode == "gather" for c in CASES_W2)


@pytest.mark.parametrize("mode", MODES)
def test_sync_free_equals_synced_w1_w4(mode):
    res = run_cpu_world(1, _equal_world, [(1, "bf16", False, (6,), False, False),
                                          (2, "bf16", True, (5,), False, False)], mode, timeout_s=150)
    _check(res, lambda c: TM * K + 4 * (c[0] - 1))  # L = 4 local experts at every world size
    res = run_cpu_world(4, _equal_world, [(2, "bf16", False, (4, 0, 6, 3), False, False)], mode, timeout_s=150)
    _check(res, lambda c: 4 * TM * K + 4 * (c[0] - 1))


def test_mode_rule_and_refusals(monkeypatch):
    """The default rule (one-hop for a decode-sized bf16 buffer, gather otherwise: the measured winners), the
    variable's override (read by build_config into the agreed config), and the refusals named at construction."""
    from tritonep.ep.config import build_config
    from tritonep.backends.nccl.sync_free import sync_free_mode

    def cfg(wire="bf16", T=128, W=2):
        return build_config(world_size=W, num_experts=2 * W, hidden=128, max_tokens_per_rank=T, topk=2,
                            dispatch_wire=wire, device_type="cpu")

    monkeypatch.delenv("TRITONEP_NCCL_SYNC_FREE", raising=False)
    assert sync_free_mode(cfg()) == "onehop" and sync_free_mode(cfg(T=256)) == "onehop"
    assert sync_free_mode(cfg(T=257)) == "gather" and sync_free_mode(cfg(wire="fp8")) == "gather"
    assert sync_free_mode(cfg(W=64)) == "gather"
    monkeypatch.setenv("TRITONEP_NCCL_SYNC_FREE", "gather")
    assert sync_free_mode(cfg()) == "gather"
    monkeypatch.setenv("TRITONEP_NCCL_SYNC_FREE", "onehop")
    assert sync_free_mode(cfg()) == "onehop"
    monkeypatch.setenv("TRITONEP_NCCL_SYNC_FREE", "onehop")
    assert sync_free_mode(cfg(T=4096)) == "onehop"
    with pytest.raises(WireError, match="'fp8'"):
        sync_free_mode(cfg(wire="fp8"))
    with pytest.raises(ConfigError, match="world_size=64"):
        sync_free_mode(cfg(W=64))
    monkeypatch.setenv("TRITONEP_NCCL_SYNC_FREE", "one-hop")
    with pytest.raises(ConfigError, match="'one-hop'"):
        cfg()  # a bad value is refused before the constructor's collective, like every TRITONEP_* value


# ------------------------------------------------------------------------------------------------ errors
def _raised(fn):
    try:
        fn()
    except (InputError, PeerInputError, CapacityError) as e:
        return type(e).__name__, str(e), getattr(e, "bad_ranks", None)
    return None


def _error_world(group, ut, mode):
    rank = dist.get_rank(group)
    buf = _buffer(group, mode, E, H, TM, K, max_recv_tokens=20)
    assert backend_of(buf).sync_free_mode == mode
    backend_of(buf).use_triton = ut
    x, idx, w = _inputs(rank, 5, 3)
    log = {}
    # 1) a bad id on rank 1: nothing raised in the call, nothing lands anywhere, every rank raises at check()
    bad = idx.clone()
    if rank == 1:
        bad[3, 1] = E + 5
    reads = buf.host_reads
    d = buf.dispatch(x, bad, w, sync_free=True)
    log["bad_call"] = (buf.host_reads - reads, d.num_tokens_per_expert.tolist(), d.expert_offsets.tolist(),
                       bool(d.weights.any()))
    log["bad_check"] = _raised(buf.check)
    log["clean_check"] = _raised(buf.check)  # reported once
    # 2) a good sync-free call still works (the word was cleared)
    d = buf.dispatch(x, idx, w, sync_free=True)
    log["good_R"] = int(d.expert_offsets[-1])
    # 3) capacity: every route of both ranks to rank 0 (experts 0, 1, 2)
    big_x, big_idx, big_w = _inputs(rank, TM, 4)
    big_idx[:, 0], big_idx[:, 1], big_idx[:, 2] = 0, 1, 2  # every route to rank 0: 2 * 6 * 3 = 36 rows > 20
    d = buf.dispatch(big_x, big_idx, big_w, sync_free=True)
    log["cap_call"] = (d.num_tokens_per_expert.tolist(), bool(d.weights.any()))
    # ... raised by the next synced dispatch on every rank, which moves nothing; then the buffer works
    log["cap_next"] = _raised(lambda: buf.dispatch(x, idx, w))
    s = buf.dispatch(x, idx, w)
    log["after_R"] = s.x.shape[0]
    # 4) a refused input (T > max_tokens_per_rank) on rank 0 in a sync-free call: rank 0 raises at once, every
    # rank raises at check()
    xx, ii, ww = _inputs(rank, TM + 1 if rank == 0 else 4, 5)
    log["refused_call"] = _raised(lambda: buf.dispatch(xx, ii, ww, sync_free=True))
    log["refused_check"] = _raised(buf.check)
    # 5) two refusals unread: the first one's code, every one's bad ranks
    buf.dispatch(big_x, big_idx, big_w, sync_free=True)
    buf.dispatch(x, bad, w, sync_free=True)
    log["two"] = _raised(buf.check)
    buf.close()
    return log


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ut", [False, True])
def test_sync_free_errors_raised_on_every_rank(ut, mode):
    logs = run_cpu_world(2, _error_world, ut, mode, timeout_s=150)
    for rank, log in enumerate(logs):
        reads, ntpe, offs, anyw = log["bad_call"]
        assert reads == 0 and not any(ntpe) and not any(offs) and not anyw, log["bad_call"]
        kind, msg, ranks = log["bad_check"]
        if rank == 1:
            assert kind == "InputError" and f"= {E + 5}" in msg and "[3, 1]" in msg, msg
        else:
            assert kind == "PeerInputError" and ranks == [1], (kind, msg)
        assert log["clean_check"] is None
        assert log["good_R"] > 0
        assert not any(log["cap_call"][0]) and not log["cap_call"][1]
        kind, msg, _ = log["cap_next"]
        assert kind == "CapacityError" and "rank 0 would receive 36 rows" in msg and "max_recv_tokens=20" in msg, msg
        assert log["after_R"] > 0
        if rank == 0:
            assert log["refused_call"][0] == "CapacityError"
        else:
            assert log["refused_call"] is None
        kind, msg, ranks = log["refused_check"]
        assert kind == "PeerInputError" and ranks == [0], (kind, msg)
        kind, msg, _ = log["two"]
        if rank == 1:  # its own bad id, named, also behind the earlier capacity refusal
            assert kind == "InputError" and f"= {E + 5}" in msg, msg
        else:
            assert kind == "CapacityError" and "2 sync_free dispatch(es)" in msg and "[1]" in msg, msg


# ------------------------------------------------------------------------------------------------ plan kernel
def _matrix(W, Ee, gen, bad=None, refused=None, hot=False):
    m = np.zeros((W, Ee + W + 2), dtype=np.int32)
    m[:, :Ee] = torch.randint(0, 7, (W, Ee), generator=gen).numpy()
    if hot:
        m[:, 0] = 2000
    L = Ee // W
    for s in range(W):
        m[s, Ee:Ee + W] = [m[s, d * L:(d + 1) * L].sum() // 2 for d in range(W)]
    if bad is not None:
        m[bad, Ee + W] = 3
    if refused is not None:
        m[refused, Ee + W + 1] = 1
    return m


@pytest.mark.parametrize("W", [1, 2, 4])
def test_device_plan_kernel_equals_twin_and_host_plan(W):
    from tritonep.backends.nccl.pack import pow2
    from tritonep.runtime.launch import Launch
    from tritonep.backends.nccl.plan import device_plan_torch, host_plan, plan_size, sf_plan_size, status_size
    from tritonep.runtime.status import STATUS_BAD_INPUT, STATUS_CAPACITY
    from tritonep.backends.nccl.kernels.plan import sync_free_plan_kernel

    gen = torch.Generator().manual_seed(W)
    Ee, tcap, maxr = 4 * W, 9, 1000
    launch = Launch("cpu", record=False, max_programs=0)
    cases = [dict(), dict(hot=True), dict(bad=W - 1), dict(refused=0), dict(bad=0, hot=True)]
    for A in (1, 3):
        for rank in range(W):
            st = {ut: torch.zeros(status_size(W), dtype=torch.int32) for ut in (False, True)}
            for kw in cases:
                m = _matrix(W, Ee, gen, **kw)
                mt = torch.from_numpy(m.copy()).view(-1)
                plans = {}
                for ut in (False, True):
                    plan = torch.full((sf_plan_size(W, Ee),), -7, dtype=torch.int32)
                    if ut:
                        launch.bind(sync_free_plan_kernel, dict(
                            m_ptr=mt, st_ptr=st[ut], rank=rank, W=W, E=Ee, L=Ee // W, A=A, TCAP=tcap, MAXR=maxr,
                            WB=pow2(W), LB=pow2(Ee // W), CODE_CAP=STATUS_CAPACITY, CODE_BAD=STATUS_BAD_INPUT,
                            num_warps=4), ("plan_ptr",))((1,), plan)
                    else:
                        device_plan_torch(mt, rank, W, Ee, A, tcap, maxr, plan, st[ut],
                                          (STATUS_CAPACITY, STATUS_BAD_INPUT))
                    plans[ut] = plan
                assert torch.equal(plans[True], plans[False]), (W, A, rank, kw)
                assert torch.equal(st[True], st[False]), (W, A, rank, kw, st)
                hp = np.zeros(plan_size(W, Ee), dtype=np.int32)
                need, _, rs = host_plan(m, rank, W, Ee, A, hp)
                p = plans[False].numpy()
                L = Ee // W
                err = bool(m[:, Ee + W:].any()) or need.max() > maxr
                assert (p[:Ee] == hp[:Ee]).all() and (p[Ee:Ee + W] == np.arange(W) * tcap).all()
                assert (p[Ee + W + 2 * L:-W] == hp[Ee + W + 2 * L:]).all()
                if err:
                    assert not p[Ee + W:Ee + W + 2 * L].any() and not p[-W:].any(), (kw, p)
                else:
                    assert (p[Ee + W:Ee + W + 2 * L] == hp[Ee + W:Ee + W + 2 * L]).all()
                    assert tuple(p[-W:].tolist()) == rs
            s = st[False].tolist()
            # refusals: hot (capacity) first, then bad ids, refused, bad + hot: code capacity, 4 seen, flags gathered
            assert s[0] == STATUS_CAPACITY and s[1] == 0 and s[2] == 4 and s[3] >= 2000 * W, s
            flags = [int(r in (0, W - 1)) for r in range(W)] + [int(r == 0) for r in range(W)]
            assert s[4:] == flags, s
