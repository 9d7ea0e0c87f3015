"""The host protocol rule (docs/protocols.md (host protocol rule)) on the CPU world: the launch-sequence recorder, uneven per-rank T scripts,
and a bad input on one rank failing the call on every rank (issue 14 cases 2 and 3)."""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.ep.triton.launch import Launcher
from tritonep.kernels.layout import chunk_hist_kernel
from tritonep.reference import combine_reference_partial, dispatch_reference
from tritonep.testing import ProtocolMismatch, run_cpu_world
from tritonep.testing.cases import make_rank_inputs

BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------------ the recorder
def _rank_dependent_world(group, extra_on):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    d = buf.dispatch(x, idx, w)
    dist.all_reduce(torch.zeros(1), group=group)  # recorded as ("collective", "all_reduce") on every rank
    if rank == extra_on:  # a launch only this rank makes (harmless here, a deadlock or mis-pairing on a GPU)
        launch = Launcher(torch.device("cpu"))
        launch(chunk_hist_kernel, (1,), idx, torch.zeros(1, 5, dtype=torch.int32), 8, 1, K=2, E=4, EB=4, BT=16,
               KB=2)
    buf.combine(d.x, d.handle)
    buf.close()
    return "done"


def test_recorder_fails_a_rank_dependent_launch():
    with pytest.raises(ProtocolMismatch) as ei:
        run_cpu_world(2, _rank_dependent_world, 1, timeout_s=60)
    msg = str(ei.value)
    assert "chunk_hist_kernel" in msg and "rank 1" in msg, msg
    seqs = ei.value.sequences
    assert len(seqs) == 2 and len(seqs[1]) == len(seqs[0]) + 1
    assert ("collective", "all_reduce") in seqs[0] and ("launch", "exchange_kernel", (1,)) in seqs[0], seqs[0]
    # the same world with no rank-dependent launch passes, and its sequences hold the dispatch/combine launches
    assert run_cpu_world(2, _rank_dependent_world, -1, timeout_s=60) == ["done", "done"]


# ------------------------------------------------------------------------------------------------ per-rank T script
# every call changes T on every rank, 0 and Tmax included; rank 1 starts with T=0 (data-parallel decode)
T_SCRIPT = {2: [[1, 0], [2, 0], [0, 3], [8, 8], [0, 0], [5, 1], [8, 0], [3, 7]],
            3: [[1, 0, 2], [0, 0, 8], [8, 3, 0], [2, 8, 1]]}


def _script_world(group, cfg, calls, geometry):
    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], backend=cfg["backend"])
    outs = []
    for x, idx, w in calls[rank]:
        d = buf.dispatch(x, idx, w)
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_((d.x.float() * 0.5 + 1.0).to(BF16))
        y = buf.combine(eo, d.handle)
        outs.append(dict(x=d.x.clone(), offs=d.expert_offsets.clone(), w=d.weights.clone(), eo=eo.clone(),
                         y=y.clone()))
    buf.close()
    return outs


def _check_script(W, cfg, calls, res):
    for i in range(len(calls[0])):
        xs, idxs, ws = ([calls[r][i][j] for r in range(W)] for j in range(3))
        ref = dispatch_reference(xs, idxs, ws, cfg["E"], W)
        for r in range(W):
            for k, want in (("x", ref[r].x), ("offs", ref[r].expert_offsets), ("w", ref[r].weights)):
                assert torch.equal(res[r][i][k], want), f"call {i} rank {r} (T={[len(x) for x in xs]}): {k}"
        yp = combine_reference_partial([res[r][i]["eo"] for r in range(W)], ref, idxs, ws, [len(x) for x in xs])
        for r in range(W):
            assert torch.equal(res[r][i]["y"], yp[r].to(BF16)), f"call {i} rank {r}: y"


@pytest.mark.parametrize("W,backend,geometry", [(2, "triton", ""), (2, "triton", "fs=1,fe=1"), (3, "triton", ""),
                                                (2, "triton", "bt=2,dec=3"), (3, "triton", "bt=2,dec=2"),
                                                (2, "nccl", "")])
def test_per_rank_token_script(W, backend, geometry):
    cfg = dict(E=4 * W, H=64, Tmax=8, K=4, backend=backend)
    calls = [[make_rank_inputs(r, ts[r], cfg["H"], cfg["E"], cfg["K"], seed=100 + i, mask_frac=0.1)
              for i, ts in enumerate(T_SCRIPT[W])] for r in range(W)]
    res = run_cpu_world(W, _script_world, cfg, calls, geometry, timeout_s=240)
    _check_script(W, cfg, calls, res)


# ------------------------------------------------------------------------------------------------ bad input
def _bad_input_world(group, backend, how, sync, geometry=""):
    os.environ["TRITONEP_SYNC_CHECKS"] = "1" if sync else "0"
    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    rank = dist.get_rank(group)
    E, H, Tm, K = 8, 64, 8, 1
    buf = tep.EPBuffer(group, E, H, Tm, K, backend=backend)
    g = torch.Generator().manual_seed(7 + rank)
    steps = []
    for step in range(3):
        T = 1 + step
        x = torch.randn(T, H, generator=g).to(BF16)
        idx = torch.randint(0, E, (T, K), generator=g)
        w = torch.rand(T, K, generator=g)
        if step == 1 and rank == 1:
            if how == "id":
                idx[T - 1, 0] = 99
            elif how == "shape":
                x = torch.randn(T, H + 1, generator=g).to(BF16)
            else:  # "capacity": more tokens than max_tokens_per_rank
                x, idx, w = torch.zeros(Tm + 1, H, dtype=BF16), torch.zeros(Tm + 1, K, dtype=torch.int64), \
                    torch.ones(Tm + 1, K)
        try:
            d = buf.dispatch(x, idx, w)
            y = buf.combine(d.x, d.handle)
            if not sync:
                buf.check()
            steps.append(("ok", x, idx, w, d.x.clone(), y.clone()))
        except tep.errors.PeerInputError as e:
            steps.append(("peer", e.bad_ranks, str(e)))
        except (tep.errors.InputError, tep.errors.CapacityError) as e:
            steps.append(("own", type(e).__name__, str(e)))
    buf.close()
    return steps


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["id", "shape", "capacity"])
def test_bad_input_on_one_rank_fails_every_rank_then_pairs(backend, how):
    res = run_cpu_world(2, _bad_input_world, backend, how, True, timeout_s=120)
    # step 1: rank 1 names its own value, rank 0 names rank 1
    kind, name, text = res[1][1]
    assert kind == "own", res[1][1]
    if how == "id":
        assert name == "InputError" and "99" in text and "topk_idx[1, 0]" in text, text
    elif how == "shape":
        assert name == "InputError" and "65" in text, text
    else:
        assert name == "CapacityError" and "9" in text, text
    assert res[0][1][0] == "peer" and res[0][1][1] == [1] and "rank(s) [1]" in res[0][1][2], res[0][1]
    # steps 0 and 2 pair correctly on every rank (nothing of the refused step leaks into the next one)
    for step in (0, 2):
        xs, idxs, ws = ([res[r][step][j] for r in range(2)] for j in (1, 2, 3))
        ref = dispatch_reference(xs, idxs, ws, 8, 2)
        yp = combine_reference_partial([res[r][step][4] for r in range(2)], ref, idxs, ws, [len(x) for x in xs])
        for r in range(2):
            assert res[r][step][0] == "ok"
            assert torch.equal(res[r][step][4], ref[r].x), f"step {step} rank {r}: rows"
            assert torch.equal(res[r][step][5], yp[r].to(BF16)), f"step {step} rank {r}: y"


@pytest.mark.parametrize("geometry", ["", "bt=2,dec=3"])
def test_bad_input_without_sync_checks_raises_on_every_rank(geometry):
    """Sync checks off: the bad rank raises at once, the peers at their check() of the same call; next call pairs
    (also with the one-launch decode dispatch, which flags the id on the device)."""
    res = run_cpu_world(2, _bad_input_world, "triton", "id", False, geometry, timeout_s=120)
    assert res[1][1][0] == "own" and "99" in res[1][1][2]
    assert res[0][1][0] == "peer" and res[0][1][1] == [1]
    assert res[0][2][0] == "ok" and res[1][2][0] == "ok"


def _timeout_s_world(group):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2, timeout_s=1.5)
    assert buf.timeout_s == 1.5 and buf._impl.timeout_s == 1.5
    if rank == 1:
        return "skipped"
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=2)
    try:
        buf.dispatch(x, idx, w)
        return "no error"
    except tep.errors.PeerTimeoutError as e:
        return str(e)


def test_timeout_is_per_buffer_and_states_the_measured_wait():
    msg = run_cpu_world(2, _timeout_s_world, timeout_s=120, check_protocol=False)[0]
    waited = float(msg.split("after waiting ")[1].split(" s")[0])  # measured wall time, also in the interpreter
    assert 1.5 <= waited < 30 and "bound 1.5 s" in msg, msg


def test_default_timeout_is_at_least_300_s(monkeypatch):
    monkeypatch.delenv("TRITONEP_TIMEOUT_S", raising=False)
    assert tep.envs.timeout_s() >= 300
    with pytest.raises(tep.errors.ConfigError, match="timeout_s"):
        from tritonep.ep.status import resolve_timeout
        resolve_timeout(-1)


# ------------------------------------------------------------------------------------------------ host reads
def _reads_world(group, mode):
    os.environ["TRITONEP_SYNC_CHECKS"] = mode
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, 64, 8, 2, backend="triton")
    x, idx, w = make_rank_inputs(rank, 8, 64, 8, 2, seed=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    impl = buf._impl
    reads = []
    for _ in range(2):
        n0 = impl.host_reads
        d = buf.dispatch(x, idx, w)
        n1 = impl.host_reads
        y = buf.combine((d.x.float() * 0.5).to(BF16), d.handle)
        n2 = impl.host_reads
        y.float().sum().backward()
        reads.append((n1 - n0, n2 - n1, impl.host_reads - n2))
    buf.close()
    return reads


@pytest.mark.parametrize("mode,want", [("deferred", (1, 0, 0)), ("1", (2, 1, 2)), ("0", (0, 0, 0))])
def test_host_reads_per_call(mode, want):
    """Deferred (default): one host read per dispatch, none in combine or either backward; strict adds one status
    read at the end of every call; 0 reads nothing."""
    for reads in run_cpu_world(2, _reads_world, mode, timeout_s=120):
        assert reads == [want, want], reads


def _deferred_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    d = buf.dispatch(x, idx, w)
    if rank == 0:  # a peer that stops during the combine of call 1
        buf._impl._launch = lambda *a, **k: None
        return "stopped"
    y = buf.combine(d.x, d.handle)  # deferred: returns (rows of rank 0 missing), no host read
    try:
        buf.dispatch(x, idx, w)
        return ("no error", y.shape)
    except tep.errors.PeerTimeoutError as e:
        return (e.wait, e.peer)


def test_deferred_checks_raise_a_lost_peer_at_the_next_dispatch():
    res = run_cpu_world(2, _deferred_world, timeout_s=120, check_protocol=False)  # rank 0 stops on purpose
    assert res[1][0] in ("combine.data", "combine.ack", "dispatch.counts") and res[1][1] == 0, res[1]


def test_every_signalling_kernel_is_launched_through_a_launcher():
    """Kernels launched directly (``name[grid](...)``) escape the recorder: none of them may signal or wait."""
    import pathlib
    import re

    root = pathlib.Path(tep.__file__).parent
    sources = {p: p.read_text() for p in root.rglob("*.py") if "testing" not in p.parts}  # test-only kernels aside
    bodies = {}
    for text in sources.values():
        for m in re.finditer(r"^def (\w+)\(.*?(?=^(?:@|def |class )|\Z)", text, re.S | re.M):
            bodies[m.group(1)] = m.group(0)
    signalling = re.compile(r"\b(signal_peers|signal_one|publish_epoch|publish_epoch_one|wait_all_ge|wait_ge)\(")

    def signals(name, seen=()):
        body = bodies.get(name, "")
        if signalling.search(body):
            return True
        return any(signals(c, seen + (name,)) for c in re.findall(r"\b(\w+)\(", body)
                   if c in bodies and c not in seen and c != name)

    direct = {m.group(1) for p, text in sources.items() if p.name != "launch.py"
              for m in re.finditer(r"\b(\w+)\[[^\]]*\]\(", text) if m.group(1) in bodies}
    assert direct, "the scan found no direct launch at all (regex broken?)"
    bad = sorted(k for k in direct if signals(k))
    assert not bad, f"signalling kernels launched outside a Launcher (invisible to the recorder): {bad}"
