"""The nccl backend's call contract: a bad expert id or a refused input on one rank fails the call on every rank
before any row moves and the next call pairs; the wait bound comes from the config; combine takes an expert output
with spare rows (and its backward gives them zero gradient); dispatch reads the host once per call, combine and the
backward passes never (counted on the CPU, and with torch's sync debug mode on the GPU)."""

import pytest
import torch
import torch.distributed as dist

from tritonep.ep import EPBuffer
from tritonep.errors import TritonEPError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import random_routing
from tests.support.harness import check_calls, record
from tests.support.hooks import backend_of


_BE, _BH, _BT, _BK = 8, 64, 8, 1


def _step_inputs(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    T = (3, 5)[rank] if step == 1 else (6, 4)[rank]
    idx = torch.randint(0, _BE, (T, _BK), generator=gen)
    if step == 2:
        idx[1, 0] = -1
    x = torch.randn(T, _BH, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, _BK, generator=gen) + 0.1
    return x, idx, w


def _bad_body(group, mode):
    """Step 1 with a bad input somewhere (NcclEP called directly: the front door passes ``bad_input``), then a
    valid step 2 through EPBuffer on every rank."""
    rank = dist.get_rank(group)
    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl", device="cpu")
    moved = [0]
    orig = dist.all_to_all_single

    def counted(*a, **k):
        moved[0] += 1
        return orig(*a, **k)

    dist.all_to_all_single = counted
    try:
        x, idx, w = _step_inputs(rank, 1)
        bad_input = False
        if mode in ("ids", "both") and rank == (1 if mode == "ids" else 0):
            idx[3 if rank == 1 else 1, 0] = 99
        if mode == "neg" and rank == 1:
            idx[2, 0] = -2
        if (mode == "refused" and rank == 1) or (mode == "both" and rank == 1):
            x, idx, w = (torch.empty(0, _BH, dtype=torch.bfloat16), torch.empty(0, _BK, dtype=torch.int64),
                         torch.empty(0, _BK))
            bad_input = True
        err = None
        try:
            backend_of(buf).dispatch_fwd(x, idx, w.float(), True, bad_input=bad_input)
        except TritonEPError as e:
            err = (type(e).__name__, str(e), getattr(e, "bad_ranks", None), getattr(e, "rank", None))
        moved_1 = moved[0]
        x2, idx2, w2 = _step_inputs(rank, 2)
        d = buf.dispatch(x2, idx2, w2)
        eo = (d.x.float() * 0.75 + 0.5).to(torch.bfloat16)
        y = buf.combine(eo, d.handle)
        return dict(record(d, eo, y), err=err, moved_1=moved_1)
    finally:
        dist.all_to_all_single = orig
        buf.close()


def _check_step2(res):
    for r in range(2):
        assert res[r]["moved_1"] == 0, f"rank {r}: rows moved in the failed call"
    check_calls(dict(E=_BE), [[_step_inputs(r, 2)] for r in range(2)], [[res[r]] for r in range(2)])


@pytest.mark.parametrize("mode", ["ids", "neg"])
def test_bad_expert_id_raises_on_every_rank_and_next_call_pairs(mode):
    res = run_cpu_world(2, _bad_body, mode, timeout_s=120)
    name, msg, _, _ = res[1]["err"]
    assert name == "InputError", res[1]["err"]
    bad_val, pos = ("99", "topk_idx[3, 0]") if mode == "ids" else ("-2", "topk_idx[2, 0]")
    assert bad_val in msg and pos in msg, msg
    name, msg, bad_ranks, rank = res[0]["err"]
    assert name == "PeerInputError" and bad_ranks == [1] and rank == 0, res[0]["err"]
    assert "rank(s) [1]" in msg and "no rows moved" in msg
    _check_step2(res)


def test_refused_input_flag_raises_on_every_rank_and_next_call_pairs():
    res = run_cpu_world(2, _bad_body, "refused", timeout_s=120)
    for r in range(2):
        name, msg, bad_ranks, rank = res[r]["err"]
        assert name == "PeerInputError" and bad_ranks == [1] and rank == r, res[r]["err"]
        assert "rank(s) [1]" in msg and "refused" in msg
    _check_step2(res)


def test_bad_ids_and_refused_input_on_different_ranks():
    res = run_cpu_world(2, _bad_body, "both", timeout_s=120)
    name, msg, _, _ = res[0]["err"]
    assert name == "InputError" and "99" in msg and "topk_idx[1, 0]" in msg, res[0]["err"]
    name, msg, bad_ranks, rank = res[1]["err"]
    assert name == "PeerInputError" and bad_ranks == [0, 1] and rank == 1, res[1]["err"]
    _check_step2(res)


def test_timeout_comes_from_the_config():
    from tritonep.ep.config import build_config
    from tritonep.backends.nccl.backend import NcclEP

    cfg = build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=4, topk=2, backend="nccl",
                       device_type="cpu", timeout_s=7.5)
    ep = NcclEP(cfg, group=None, rank=0, device=torch.device("cpu"))
    assert ep.timeout_s == 7.5 and ep.cfg is cfg


def _spare_rows(group):
    rank = dist.get_rank(group)
    x, idx, w = _step_inputs(rank, 2)
    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl", device="cpu", expert_alignment=2)
    out = {}
    for spare in (0, 3):
        d = buf.dispatch(x, idx, w)
        R = d.x.shape[0]
        eo = torch.cat([(d.x.float() * 0.5).to(torch.bfloat16), torch.full((spare, _BH), 7.0).to(torch.bfloat16)])
        eo.requires_grad_()
        y = buf.combine(eo, d.handle)
        y.float().sum().backward()
        out[spare] = dict(y=y.detach(), g=eo.grad, R=R)
    buf.close()
    return out


def test_combine_accepts_spare_expert_out_rows_with_backward():
    for r in run_cpu_world(2, _spare_rows):
        a, b = r[0], r[3]
        assert torch.equal(a["y"], b["y"])
        assert b["g"].shape[0] == a["R"] + 3
        assert torch.equal(b["g"][:a["R"]], a["g"]) and not b["g"][a["R"]:].any()


def _reads(group):
    rank = dist.get_rank(group)
    x, idx, w = _step_inputs(rank, 2)
    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl", device="cpu", expert_alignment=2)
    impl = backend_of(buf)
    x.requires_grad_()
    w.requires_grad_()
    reads = []
    for _ in range(2):
        n0 = impl.host_reads
        d = buf.dispatch(x, idx, w)
        n1 = impl.host_reads
        y = buf.combine((d.x.float() * 0.5).to(torch.bfloat16), d.handle)
        n2 = impl.host_reads
        y.float().sum().backward()
        reads.append((n1 - n0, n2 - n1, impl.host_reads - n2))
    buf.close()
    return reads


def test_host_reads_per_call():
    """One host read per dispatch (the counts matrix), one per eager combine (every rank's refused flag), none in
    either backward."""
    for reads in run_cpu_world(2, _reads):
        assert reads == [(1, 1, 0), (1, 1, 0)], reads


def _host_syncs(group):
    import traceback
    import warnings

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, Tm, K = 64, 512, 128, 4
    buf = EPBuffer(group, E, H, Tm, K, backend="nccl", device=dev, expert_alignment=4)
    impl = backend_of(buf)
    idx, w = random_routing(100 + 7 * rank, E, K, seed=rank, mask_frac=0.1)
    x = torch.randn(idx.shape[0], H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
    idx, w = idx.to(dev), w.to(dev)

    def calls(count):
        out, out_w, _, _, h = impl.dispatch_fwd(x, idx, w, True)
        count("dispatch")
        eo = (out.float() * 0.5).to(torch.bfloat16)
        impl.combine_fwd(eo, h)
        count("combine")
        impl.dispatch_bwd(eo, out_w.clone(), h)
        count("dispatch_bwd")
        impl.combine_bwd(x, eo, h)
        count("combine_bwd")

    calls(lambda what: None)  # warm-up: compiles the kernels, creates the communicators
    torch.cuda.synchronize()
    seen, where, rec = {}, {}, []

    def hook(message, category, filename, lineno, file=None, line=None):
        # the innermost Python frame of each sync: the library's (tritonep/, not tritonep/testing/) are counted,
        # any other (this test's own ops, the harness) is listed in the failure message only
        if "synchroniz" in str(message):
            f = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/warnings" not in f.filename)
            rec.append((f"{f.filename}:{f.lineno}", "/tritonep/" in f.filename and "/tritonep/testing/" not in
                        f.filename))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            def count(what):
                n = sum(len(v) for v in where.values())
                where[what] = rec[n:]
                seen[what] = sum(lib for _, lib in where[what])
            calls(count)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    buf.close()
    return seen, where


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 2])
def test_gpu_nccl_host_reads(gpu_world, W):
    """Dispatch reads the host once (the counts matrix); combine and both backward passes never."""
    for seen, where in gpu_world(W, _host_syncs, nccl=True):
        assert seen == {"dispatch": 1, "combine": 0, "dispatch_bwd": 0, "combine_bwd": 0}, where


def _handle_fields(group, sync_free, mode):
    import dataclasses

    from tritonep.backends.nccl.handle import NcclHandle
    from tests.support.harness import set_env

    set_env(TRITONEP_NCCL_SYNC_FREE=mode)

    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl")
    h = buf.dispatch(*_step_inputs(dist.get_rank(group), 1), sync_free=sync_free).handle
    names = {f.name for f in dataclasses.fields(NcclHandle)}
    same = NcclHandle(**{n: getattr(h, n) for n in names}) == h  # the fast-built handle equals the constructor's
    buf.close()
    return sorted(set(h.__dict__) ^ names), same


@pytest.mark.parametrize("sync_free,mode", [(False, None), (True, "onehop"), (True, "gather")])
def test_fast_built_handle_has_every_field(sync_free, mode):
    """The dispatch builds its handle with ``NcclHandle._new`` (no generated ``__init__``): every dataclass field is
    set, nothing else, and it equals the handle the constructor makes of the same values."""
    for extra, same in run_cpu_world(2, _handle_fields, sync_free, mode, timeout_s=120):
        assert extra == [] and same
