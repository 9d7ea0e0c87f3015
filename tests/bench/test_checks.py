"""Every benchmark point checks itself: the on-device oracles equal the reference oracles, a correct CPU
run of each driver records ``checked: true`` on every row and exits 0, a corrupted output makes its points FAILED
and the run exit 1."""

import json
import os

import pytest
import torch

from tritonep.bench.check import (bench_expert, compare_close, exit_code, mark_checked, rank_combine_oracle,
                                  rank_dispatch_oracle)
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import diff, expected

from tests import ROOT, load_script


def _driver(name):
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.is_file():
        path = ROOT / "benchmarks" / "probes" / f"{name}.py"
    return load_script(str(path.relative_to(ROOT)), f"_bench_{name}")


@pytest.mark.parametrize("W,A", [(2, 1), (3, 2), (4, 1)])
def test_rank_oracles_equal_the_reference(W, A):
    E, H, T, K = 4 * W, 32, 9, 3
    ins = [make_rank_inputs(r, T, H, E, K, seed=5, mask_frac=0.2) for r in range(W)]
    xs, idxs, ws = [i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins]
    want = expected(ins, E, A, fn=bench_expert)
    x_all, idx_all, w_all = torch.stack(xs), torch.stack(idxs), torch.stack(ws)
    for r in range(W):
        o = rank_dispatch_oracle(x_all, idx_all, w_all, E, r, expert_alignment=A)
        y = rank_combine_oracle(bench_expert(xs[r]), idxs[r], ws[r], E, W)
        got = dict(x=o["x"], ntpe=o["num_tokens_per_expert"], offs=o["expert_offsets"], w=o["weights"], y=y)
        assert diff(got, want[r]) == [], r
        ref = want[r]["ref"]
        src = torch.where(ref.src_rank >= 0, ref.src_rank.long() * T + ref.src_token.long(), -1)
        assert torch.equal(o["src"], src)


def test_mark_and_exit_code(capsys):
    rows = [mark_checked(dict(op="a"), ""), mark_checked(dict(op="b", profile="p"), "x: differs")]
    assert rows[0]["checked"] is True and rows[1]["checked"] is False and rows[1]["check_error"] == "x: differs"
    assert exit_code(rows[:1]) == 0 and exit_code(rows) == 1 and exit_code([dict(op="never checked")]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert compare_close("y", torch.ones(3), torch.ones(3) * 1.005, 2 ** -7) == ""
    assert "max|diff|" in compare_close("y", torch.ones(3), torch.ones(3) * 1.1, 2 ** -7)


def _rows(path):
    return [r for rs in json.load(open(path))["rows"] for r in rs]


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_ep_bench_checks_every_point(tmp_path, capsys):
    """Graph-less CPU run of every point (both backends, three wires, the NCCL baselines, a fused and a small-tile
    geometry variant): all checked; a corrupted dispatch row makes those points FAILED and the run exit 1."""
    ep_bench = _driver("ep_bench")
    out = tmp_path / "ep.json"
    variants = ["x:0:bf16:bt=2,fs=2,fe=3,fc=1", "x:0:fp8:bt=1,grid=5"]
    assert ep_bench.main(["--cpu", "--json", str(out), "--variants", *variants]) == 0
    rows = _rows(out)
    ops = {r["op"] for r in rows}
    assert {"tritonep.dispatch.mxfp4", "tritonep.combine.pull.bf16", "tritonep[nccl].combine.bf16", "nccl.a2a",
            "nccl.pipeline.combine", "nccl.pipeline_full.dispatch", "tritonep[nccl].dispatch_sync_free_onehop.bf16",
            "tritonep[nccl].dispatch_sync_free_gather.bf16", "tritonep[nccl].combine_sync_free_onehop.bf16"} <= ops
    assert {"tritonep.dispatch.fp8.kept", "tritonep.dispatch.mxfp4.kept"} <= ops  # keep_quantized rows
    # 23 points a rank: without CUDA the bf16 graph and eager points are one eager call, run once
    assert len(rows) == 2 * 23 and all(r["checked"] is True for r in rows)
    assert len({(r["op"], r.get("variant"), r["mode"]) for r in rows}) == 23  # no point twice
    assert sum(1 for r in rows if r.get("variant")) == 2 * 5
    # a registered wire beyond the three defaults: its points check against its own twins
    assert ep_bench.main(["--cpu", "--wires", "fp8_e5m2", "--json", str(out)]) == 0
    rows = [r for r in _rows(out) if "fp8_e5m2" in r["op"]]
    assert rows and all(r["checked"] is True for r in rows), [r.get("check_error") for r in rows]
    capsys.readouterr()

    import tritonep.ep.buffer as epbuf

    orig = epbuf.EPBuffer.dispatch

    def corrupt(self, *a, **k):
        d = orig(self, *a, **k)
        if d.x.shape[0] > 0 and self.backend == "triton":
            d.x.view(-1)[0] += 1  # one received element
        return d

    mp = pytest.MonkeyPatch()
    mp.setattr(epbuf.EPBuffer, "dispatch", corrupt)
    try:
        assert ep_bench.main(["--cpu", "--wires", "bf16", "--json", str(out)]) == 1
    finally:
        mp.undo()
    rows = _rows(out)
    bad = {r["op"] for r in rows if not r["checked"]}
    assert "tritonep.dispatch.bf16" in bad and "nccl.a2a" not in bad
    assert all("x: differs" in r["check_error"] for r in rows if r["op"] == "tritonep.dispatch.bf16")
    assert "FAILED" in capsys.readouterr().out


def test_planner_bench_checks_every_point(tmp_path, monkeypatch, capsys):
    planner_bench = _driver("planner_bench")
    out = tmp_path / "planner.json"
    assert planner_bench.main(["--cpu", "--modes", "reference", "minimal", "--num-programs", "0", "3",
                               "--json", str(out)]) == 0
    rows = json.load(open(out))["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["checked"] is True and r["launches"] == 1 for r in rows)

    import tritonep.balance as bal

    orig = bal.plan

    def corrupt(*a, **k):
        p, rid = orig(*a, **k)
        rid.view(-1)[-1] += 1
        return p, rid

    monkeypatch.setattr(bal, "plan", corrupt)
    assert planner_bench.main(["--cpu", "--json", str(out)]) == 1
    rows = json.load(open(out))["rows"]
    assert rows and all(not r["checked"] and "runtime ids (1 of" in r["check_error"] for r in rows)
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_moe_bench_checks_every_layer(monkeypatch, capsys):
    moe_bench = _driver("moe_bench")
    args = ["--cpu", "--profile", "cpu-smoke", "--steps", "1"]
    assert moe_bench.main(args) == 0
    assert "checks: 8 of 8 layer outputs" in capsys.readouterr().out

    from tritonep.moe import MoELayer

    orig = MoELayer.forward
    monkeypatch.setattr(MoELayer, "forward", lambda self, *a, **k: orig(self, *a, **k) * 1.25)
    assert moe_bench.main(args) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "checks: 4 of 8 layer outputs" in text  # the reference layer still passes


@pytest.mark.parametrize("wire", __import__("tritonep.wire.formats", fromlist=["WIRES"]).WIRES)
def test_oracle_roundtrips_use_each_registered_wire(wire):
    """The bench oracles decode every registered wire with its own twins (a new wire such as fp8_e5m2 must not
    fall through to another format's roundtrip), and refuse a name that is not registered."""
    from tritonep.bench.check import _partial_roundtrip, wire_roundtrip
    from tritonep.errors import WireError
    from tritonep.wire.formats import get_wire

    fmt = get_wire(wire)
    x = (torch.randn(6, 256, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    part = torch.randn(6, 256, generator=torch.Generator().manual_seed(2)) * 5
    if fmt.quantized:
        want_x = fmt.dequantize_torch(*fmt.quantize_torch(x), torch.float32).to(torch.bfloat16)
        want_p = fmt.dequantize_torch(*fmt.quantize_torch(part), torch.float32)
    else:
        want_x, want_p = x, part.to(torch.bfloat16).float()
    assert torch.equal(wire_roundtrip(wire, x), want_x)
    assert torch.equal(_partial_roundtrip(wire, part), want_p)
    with pytest.raises(WireError, match="no_such_wire"):
        wire_roundtrip("no_such_wire", x)


def test_kernel_breakdown_checks_every_row(tmp_path, capsys):
    """CPU smoke of benchmarks/probes/kernel_breakdown.py: both default variants x three wires, dispatch and combine, each
    row names its kernels (send / expand, partial / out, or the one-launch kernels) and checks; a corrupted
    combine output makes the combine rows FAILED and the run exit 1."""
    kb = _driver("kernel_breakdown")
    out = tmp_path / "kb.json"
    assert kb.main(["--cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 3 * 2 and all(r["checked"] is True for r in rows)
    two = {r["op"]: set(r["kernels"]) for r in rows if r["variant"] == "two-kernel" and r["wire"] == "fp8"}
    assert {"dispatch_send_kernel", "dispatch_expand_kernel"} <= two["dispatch"]
    assert {"combine_partial_kernel", "combine_out_kernel"} <= two["combine"]
    fused = {r["op"]: set(r["kernels"]) for r in rows if r["variant"] == "fused" and r["wire"] == "mxfp4"}
    assert "dispatch_fused_kernel" in fused["dispatch"] and "combine_fused_kernel" in fused["combine"]
    assert all(r["us"] > 0 and r["us"] == pytest.approx(sum(r["kernels"].values())) for r in rows)
    capsys.readouterr()

    import tritonep.ep.buffer as epbuf

    orig = epbuf.EPBuffer.combine

    def corrupt(self, *a, **k):
        y = orig(self, *a, **k)
        y.view(-1)[0] += 1
        return y

    mp = pytest.MonkeyPatch()
    mp.setattr(epbuf.EPBuffer, "combine", corrupt)
    try:
        assert kb.main(["--cpu", "--wires", "bf16", "--variants", "two=fs=0,fe=0", "--json", str(out)]) == 1
    finally:
        mp.undo()
    rows = json.loads(out.read_text())["rows"]
    assert [r["checked"] for r in rows] == [True, False]
    assert "FAILED" in capsys.readouterr().out


def test_kernel_breakdown_extra_ops_check_and_fail(tmp_path, capsys):
    """``--extra``: the kept-quantized dispatch (fp8, checked decoded) and the combine backward (bf16: row gradient
    bit for bit, weight gradient within its bound) are rows of their own, naming the expand kernel; a combine
    backward whose row gradient is one ulp off, or whose weight gradient is off, makes its row FAILED."""
    kb = _driver("kernel_breakdown")
    out = tmp_path / "kb.json"
    argv = ["--cpu", "--extra", "--wires", "bf16", "fp8", "--variants", "two=fs=0,fe=0", "--json", str(out)]
    assert kb.main(argv) == 0
    rows = {(r["wire"], r["op"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("bf16", "dispatch"), ("bf16", "combine"), ("bf16", "combine_backward"),
                         ("fp8", "dispatch"), ("fp8", "combine"), ("fp8", "dispatch.kept")}
    assert all(r["checked"] is True for r in rows.values())
    assert "dispatch_expand_kernel" in rows[("fp8", "dispatch.kept")]["kernels"]
    assert "dispatch_expand_kernel" in rows[("bf16", "combine_backward")]["kernels"]
    capsys.readouterr()

    import tritonep.ep.buffer as epbuf

    orig = epbuf.EPBuffer.combine_backward
    for which in (0, 1):
        def corrupt(self, *a, which=which, **k):
            out = orig(self, *a, **k)
            t = out[which]
            t.view(-1)[0] = t.view(-1)[0] * 2 + 1
            return out

        mp = pytest.MonkeyPatch()
        mp.setattr(epbuf.EPBuffer, "combine_backward", corrupt)
        try:
            assert kb.main(["--cpu", "--extra", "--wires", "bf16", "--variants", "two=fs=0,fe=0",
                            "--json", str(out)]) == 1
        finally:
            mp.undo()
        got = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
        assert got["combine_backward"]["checked"] is False and got["dispatch"]["checked"] is True
        assert ("grad_rows" if which == 0 else "grad_weights") in got["combine_backward"]["check_error"]
        assert "FAILED" in capsys.readouterr().out


def test_combine_backward_check_reads_the_rows_past_the_layout_end():
    """The kernel breakdown's combine backward check: rows 0..n-1 against the dispatch of ``grad_y`` (times the
    route weight, one bf16 rounding; the dot with the expert rows), and the rows past the layout's end (``n`` =
    the last expert offset) zero in both outputs, as the expand writes them."""
    from types import SimpleNamespace

    from tritonep.bench.kernels import _check_combine_backward

    g = torch.Generator().manual_seed(0)
    R, n, H = 6, 4, 8
    x = torch.randn(R, H, generator=g).to(torch.bfloat16)
    x[n:] = 0
    wts = torch.rand(R, generator=g)
    wts[n:] = 0
    eo = torch.randn(R, H, generator=g).to(torch.bfloat16)
    d = SimpleNamespace(x=x, weights=wts, expert_offsets=torch.tensor([1, n]), handle=None)

    def check(edit=None):
        ge, gw = (x.float() * wts[:, None]).to(torch.bfloat16), (x.float() * eo.float()).sum(1)
        if edit:
            edit(ge, gw)
        buf = SimpleNamespace(combine_backward=lambda *a: (ge, gw), dispatch=lambda *a: d)
        return _check_combine_backward(dict(op="combine_backward"), buf, None, eo, d, None, None, 0)

    assert check()["checked"] is True
    bad = check(lambda ge, gw: ge[n + 1, 3].fill_(1.0))
    assert bad["checked"] is False and "rows_past_end" in bad["check_error"]
    bad = check(lambda ge, gw: gw[R - 1].fill_(0.5))
    assert bad["checked"] is False and "weights_past_end" in bad["check_error"]
    bad = check(lambda ge, gw: ge[0, 0].fill_(ge[0, 0].item() * 2 + 1))
    assert bad["checked"] is False and "grad_rows" in bad["check_error"]
