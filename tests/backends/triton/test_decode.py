"""The one-launch decode dispatch and combine (geometry ``dec=G``) in the multi-rank CPU world.

Exactness: the decode path's outputs equal the two-kernel path's on the same inputs bit for bit (rows, quantized
payload + scales, weights, num_tokens_per_expert, expert_offsets, counts snapshot, combine sums), and the
reference oracles (rows / layout exact, combine = the fixed-order reference exactly). One launch per direction,
the same launch sequence on every rank whatever its T (the recorder is on in every world), bounded waits that
name the missing peer. A decode buffer mixed with the two-kernel paths (autograd, pull combine, its own combine
tile) gives a two-kernel buffer's bits.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.runtime import recorder
from tests.support.tiles import tiles_of
from tritonep.backends.triton.tiles import DECODE_MAX_TOKENS
from tritonep.errors import ConfigError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, check_script, diff, expected, expert, script_world
from tests.support.hooks import backend_of
from tests.support.outcomes import timeout_verdict

def test_decode_geometry():
    os.environ.pop("TRITONEP_GEOMETRY", None)
    # the default for small batches on the GPU (measured, tritonep/backends/triton/tiles.py); dec=0 turns it off; CPU: off
    assert tiles_of("cuda", 2, 7168, 128, 8).decode == 128
    assert tiles_of("cuda", 1, 7168, 256, 8).decode == 128
    assert tiles_of("cuda", 2, 7168, DECODE_MAX_TOKENS + 1, 8).decode == 0
    assert tiles_of("cpu", 2, 64, 16, 2).decode == 0
    os.environ["TRITONEP_GEOMETRY"] = "dec=0"
    assert tiles_of("cuda", 2, 7168, 128, 8).decode == 0
    os.environ["TRITONEP_GEOMETRY"] = "bt=1,dec=200"
    try:
        g = tiles_of("cuda", 2, 7168, 128, 8)
        assert (g.decode, g.grid_send, g.grid_expand, g.grid_partial, g.grid_out) == (128, 128, 128, 128, 128)
        assert (g.fused_send, g.fused_combine) == (0, False)
        g = tiles_of("cuda", 2, 7168, 256, 8)
        assert g.decode == 132  # one program per SM at most
        assert tiles_of("cuda", 2, 7168, 128, 8, num_sms=24).decode == 24
        os.environ["TRITONEP_GEOMETRY"] = "fs=40,fe=88,fc=1,dec=8"  # decode wins over the fused paths
        g = tiles_of("cuda", 2, 7168, 256, 8)
        assert (g.decode, g.fused_send, g.fused_combine, g.grid_partial) == (8, 0, False, 8)
        os.environ["TRITONEP_GEOMETRY"] = "dec=8"
        with pytest.raises(ConfigError, match=f"max_tokens_per_rank <= {DECODE_MAX_TOKENS}, got 257"):
            tiles_of("cuda", 2, 7168, DECODE_MAX_TOKENS + 1, 8)
        os.environ["TRITONEP_GEOMETRY"] = "dec=-1"
        with pytest.raises(ConfigError, match="dec must be >= 0"):
            tiles_of("cuda", 2, 7168, 128, 8)
    finally:
        os.environ.pop("TRITONEP_GEOMETRY", None)


# ------------------------------------------------------------------------------------------ decode vs two kernels
def _pair_world(group, cfg, script, geometry):
    """The same script on a two-kernel buffer and on a decode buffer; returns both outputs per call."""
    os.environ["TRITONEP_SYNC_CHECKS"] = cfg.get("sync", "deferred")
    rank = dist.get_rank(group)
    E, H, Tm, K = cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"]
    bufs = {}
    for name, geo in (("two", "fs=0,fe=0"), ("one", geometry)):
        os.environ["TRITONEP_GEOMETRY"] = geo
        bufs[name] = tep.EPBuffer(group, E, H, Tm, K, expert_alignment=cfg["A"], dispatch_wire=cfg["wire"],
                                  combine_wire=cfg["wire"])
    os.environ.pop("TRITONEP_GEOMETRY", None)
    G = bufs["one"].tiles.decode
    assert G > 0 and bufs["two"].tiles.decode == 0
    rec = recorder.get_recorder()
    seen = []

    def spy(ev):
        seen.append(ev)
        if rec is not None:
            rec(ev)

    recorder.set_recorder(spy)
    out = []
    for i, ts in enumerate(script):
        x, idx, w = make_rank_inputs(rank, ts[rank], H, E, K, seed=500 + i, mask_frac=0.15)
        call = {}
        for name in ("two", "one"):
            buf = bufs[name]
            del seen[:]
            d = buf.dispatch(x, idx, w)
            n_disp = list(seen)
            eo = buf.expert_out_buffer(d.x.shape[0])
            eo.copy_(expert(d.x))
            del seen[:]
            y = buf.combine(eo, d.handle)
            n_comb = list(seen)
            R = int(d.expert_offsets[-1]) if d.expert_offsets.numel() else 0
            r = dict(x=d.x[:R].clone(), w=d.weights[:R].clone(), ntpe=d.num_tokens_per_expert.clone(),
                     offs=d.expert_offsets.clone(), counts=d.handle.counts.clone(), y=y.clone(),
                     eo=eo[:R].clone(), launches=(n_disp, n_comb), shape=tuple(d.x.shape),
                     wfull=d.weights.clone())  # with sync checks off: max_recv rows, zero past R
            if cfg["wire"] != "bf16":
                dq = buf.dispatch(x, idx, w, keep_quantized=True)
                r.update(q=dq.x[:R].clone(), s=dq.x_scales[:R].clone())
            call[name] = r
        out.append(dict(call, x=x, idx=idx, w=w))
    dist.barrier(group=group)  # every rank's last launch has signalled this rank
    impl = backend_of(bufs["one"])
    counters = (impl.flags.clone(), impl.calls.clone())  # [NUM_FLAG_ROWS, W] per-source counters, call numbers
    for buf in bufs.values():
        buf.close()
    recorder.set_recorder(rec)
    return out, G, counters


def _check_pair(W, cfg, script, res):
    from tritonep.device import protocol as P

    per_call = 2 if cfg["wire"] != "bf16" else 1  # quantized wires also dispatch with keep_quantized
    for r in range(W):  # the grid's G-weighted signals add up to the two-kernel path's per-program totals
        G, (flags, calls) = res[r][1], res[r][2]
        nd, nc = len(script) * per_call, len(script)
        assert calls[P.v(P.CALL_DISPATCH)] == nd and calls[P.v(P.CALL_EXCHANGE)] == nd, calls
        assert calls[P.v(P.CALL_COMBINE)] == nc and calls[P.v(P.DONE_DECODE_DISPATCH)] == nd * G, calls
        for row, want in ((P.FLAG_COUNTS, nd), (P.FLAG_DATA, nd * G), (P.FLAG_ACK, nd * G), (P.FLAG_CDATA, nc * G),
                          (P.FLAG_CACK, nc * G)):
            assert flags[P.v(row)].tolist() == [want] * W, (r, P.v(row), flags)
    for i, ts in enumerate(script):
        for r in range(W):
            one, two = res[r][0][i]["one"], res[r][0][i]["two"]
            for k in ("x", "w", "ntpe", "offs", "counts", "y", "q", "s"):
                if k in two:
                    assert torch.equal(one[k], two[k]), f"call {i} T={ts} rank {r}: {k}"
            assert one["shape"] == two["shape"], (i, r)
            assert torch.equal(one["wfull"], two["wfull"]), (i, r)
            G = res[r][1]
            assert one["launches"] == ([("launch", "dispatch_decode_kernel", (G,))],
                                       [("launch", "combine_decode_kernel", (G,))]), one["launches"]
        if cfg["wire"] == "bf16":  # and both equal the oracles
            calls = [(res[r][0][i]["x"], res[r][0][i]["idx"], res[r][0][i]["w"]) for r in range(W)]
            want = expected(calls, cfg["E"], cfg["A"], eos=[res[r][0][i]["one"]["eo"] for r in range(W)])
            for r in range(W):
                assert diff(res[r][0][i]["one"], want[r]) == [], (i, r)


PAIR_CASES = {
    # (W, cfg, script, geometry): uneven T, 0 included, every rank at 0, Tmax; several calls (epochs, counts parity)
    "W2-bf16-A2": (2, dict(E=8, H=64, Tmax=32, K=3, A=2, wire="bf16"), [[20, 0], [32, 7], [0, 0], [1, 32]],
                   "bt=4,dec=3"),
    "W3-bf16-G1": (3, dict(E=12, H=96, Tmax=16, K=4, A=1, wire="bf16"), [[9, 0, 16], [0, 5, 0], [16, 16, 1]],
                   "dec=1"),
    "W2-fp8": (2, dict(E=8, H=256, Tmax=16, K=3, A=1, wire="fp8"), [[16, 0], [3, 11]], "bt=2,dec=4"),
    "W3-fp8-nosync": (3, dict(E=6, H=128, Tmax=8, K=2, A=2, wire="fp8", sync="0"), [[8, 0, 3], [0, 8, 8]],
                      "bt=2,dec=2"),
}


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_decode_equals_two_kernel_path(case):
    W, cfg, script, geometry = PAIR_CASES[case]
    res = run_cpu_world(W, _pair_world, cfg, script, geometry, timeout_s=400)
    _check_pair(W, cfg, script, res)


# ------------------------------------------------------------------------------------------ bounded waits
def _skip_world(group, where):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"
    os.environ["TRITONEP_GEOMETRY"] = "bt=4,dec=2"
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 6, 2, seed=3)
    d = buf.dispatch(x, idx, w) if where == "combine" else None
    if rank == 1:
        return "skipped"
    t0 = time.monotonic()

    def call():
        if where == "combine":
            buf.combine(expert(d.x), d.handle)
        else:
            buf.dispatch(x, idx, w)
    err = timeout_verdict(call)
    return err, time.monotonic() - t0


@pytest.mark.parametrize("where,wait", [("dispatch", "dispatch.counts"), ("combine", "combine.data")])
def test_decode_peer_missing_raises_peer_timeout(where, wait):
    res = run_cpu_world(3, _skip_world, where, timeout_s=120, check_protocol=False)  # rank 1 skips on purpose
    assert res[1] == "skipped"
    for r in (0, 2):
        err, took = res[r]
        assert err[:3] == ("PeerTimeoutError", wait, 1), err
        assert "peer 1" in err[3] and f"rank {r}" in err[3], err
        assert took < 60, f"rank {r} took {took:.1f} s to give up (TRITONEP_TIMEOUT_S=2, wall time)"


def test_decode_soak_routine_on_cpu():
    """The GPU soak's rank function (tests/backends/triton/test_decode_gpu.py) with eager calls: masks 0-100 %, hot
    experts, each call against a second buffer and the host oracles."""
    from tests.support.gpu_decode import decode_soak_world

    res = run_cpu_world(2, decode_soak_world, "bt=4,dec=2", 8, 64, 16, 2, 6, False, timeout_s=300)
    assert res == [(6, []), (6, [])], res


def _bench_check_world(group, T):
    from tritonep.bench.decode_check import exact_vs_two_kernel

    os.environ["TRITONEP_GEOMETRY"] = "bt=2,dec=3"
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, 64, 8, 2)
    os.environ.pop("TRITONEP_GEOMETRY")
    x, idx, w = make_rank_inputs(rank, T[rank], 64, 8, 2, seed=9)
    ok = exact_vs_two_kernel(group, buf, x, idx, w, "bf16")
    buf.close()
    return ok


def test_bench_exactness_check_on_cpu():
    """The decode-1launch benchmark rows' ``exact_vs_two_kernel`` (tritonep/bench/decode_check.py), T=0 on a rank."""
    assert run_cpu_world(2, _bench_check_world, [8, 0], timeout_s=120) == [True, True]


def _mixed_world(group, Ts):
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"
    rank = dist.get_rank(group)
    E, H, Tm, K = 4, 64, 8, 2
    bufs = {}
    for name, geo in (("two", "bt=4,fs=0,fe=0"), ("one", "bt=4,dec=2")):
        os.environ["TRITONEP_GEOMETRY"] = geo
        bufs[name] = tep.EPBuffer(group, E, H, Tm, K, expert_alignment=2)
    os.environ.pop("TRITONEP_GEOMETRY", None)
    assert bufs["one"].tiles.decode == 2 and bufs["two"].tiles.decode == 0
    out = []
    for i, T in enumerate(Ts):
        x0, idx, w0 = make_rank_inputs(rank, T[rank], H, E, K, seed=40 + i, mask_frac=0.2)
        g = torch.randn(T[rank], H, generator=torch.Generator().manual_seed(7 + rank + i)).to(BF16)
        res = {}
        for name, buf in bufs.items():
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            d = buf.dispatch(x, idx, w)
            eo = (d.x.float() * 0.5 + 1.0).to(BF16)
            y = buf.combine(eo, d.handle)
            (y.float() * g.float()).sum().backward()
            with torch.no_grad():
                d2 = buf.dispatch(x0, idx, w0)
                yp = buf.combine((d2.x.float() * 0.25).to(BF16), d2.handle, kind="pull")
                yq = buf.combine((d2.x.float() * 0.25).to(BF16), d2.handle)  # push (decode) after the pull
            res[name] = (y.detach().clone(), x.grad.clone(), w.grad.clone(), yp.clone(), yq.clone())
        out.append([torch.equal(a, b) for a, b in zip(res["one"], res["two"])])
    for buf in bufs.values():
        buf.close()
    return out


def test_decode_buffer_autograd_and_pull_equal_two_kernel_buffer():
    Ts = [[8, 5], [0, 7], [3, 0], [8, 8]]
    res = run_cpu_world(2, _mixed_world, Ts, timeout_s=600)
    for r in range(2):
        for i, eq in enumerate(res[r]):
            assert all(eq), f"rank {r} call {i} T={Ts[i]}: (y, x.grad, w.grad, y pull, y push) equal = {eq}"


def test_w3_decode_buffer_with_own_combine_tile():
    """W = 3 decode buffer (dec=3: one-launch dispatch and push combine, tile 1) whose two-kernel combines (pull,
    dispatch backward) use a combine tile of 2 and grid 3 (rotated partial sources), alternating on one buffer."""
    W = 3
    cfg = dict(E=48, H=32, Tmax=8, K=3, A=2, geometry="bt=1,cbt=2,dec=3")
    steps = [("ok", 21, [8, 0, 5], "grad"), ("ok", 22, [1, 8, 0], "pull"), ("ok", 23, [0, 0, 0], None),
             ("bad", 24, [3, 3, 3], 0), ("ok", 25, [8, 8, 8], "grad"), ("ok", 26, [2, 7, 3], "pull")]
    res = run_cpu_world(W, script_world, cfg, steps, timeout_s=600)
    check_script(cfg, steps, res, geo=(1, 2, 3, False, 3))
