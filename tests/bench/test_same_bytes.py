"""The world-1 same-bytes references (tritonep/bench/same_bytes.py): their rows are the rows a world-1 dispatch
writes, every point checks itself, and the summary lines pair each tritonep row with its reference."""

import torch

from tritonep.bench.same_bytes import route_order, same_bytes_lines, same_bytes_points
from tritonep.reference import dispatch_reference


def _routing(T, E, K, seed=0, holes=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    if holes:
        idx[::3, 0] = -1
    return idx, torch.rand(T, K, generator=g)


def test_route_order_is_the_world1_dispatch_order():
    T, E, K, H = 37, 8, 3, 4
    for holes in (False, True):
        idx, w = _routing(T, E, K, holes=holes)
        x = torch.arange(T * H, dtype=torch.float32).view(T, H)
        ref = dispatch_reference([x], [idx], [w], E, 1)[0]
        tok, slot = route_order(idx)
        assert torch.equal(x[tok], ref.x)  # rows by expert, then token
        assert torch.equal(idx[tok, slot], torch.repeat_interleave(torch.arange(E), ref.num_tokens_per_expert))


def test_points_check_themselves_and_pair_with_tritonep_rows():
    T, E, K, H = 16, 8, 2, 256
    idx, _ = _routing(T, E, K)
    x = torch.randn(T, H).to(torch.bfloat16)
    rows, timed = [], []

    def row(name, us, mode, extra=None):
        rows.append(dict(profile="p", op=name, us=us, mode=mode, world_size=1, **(extra or {})))
        return rows[-1]

    def time_fn(fn):
        fn()
        timed.append(fn)
        return 10.0, "graph"

    made = same_bytes_points(row, x, idx, ["bf16", "fp8", "mxfp4"], time_fn)
    assert [r["op"] for r in made] == [
        "torch.same_bytes.dispatch.bf16", "torch.same_bytes.writes.dispatch.bf16",
        "torch.same_bytes.dispatch.fp8.kept", "torch.same_bytes.writes.dispatch.fp8.kept",
        "torch.same_bytes.dispatch.mxfp4.kept", "torch.same_bytes.writes.dispatch.mxfp4.kept",
        "torch.same_bytes.combine.bf16"]
    assert all(r["checked"] for r in made) and len(timed) == 7
    assert made[0]["moved_bytes"] == T * H * 2 + T * K * H * 2 and made[1]["moved_bytes"] == T * K * H * 2
    assert made[3]["moved_bytes"] == T * K * (H + H // 128 * 4)  # fp8 payload + fp32 scales of every route
    ours = [dict(profile="p", op=op, us=us, mode="graph", world_size=1) for op, us in
            (("tritonep.dispatch.bf16", 12.0), ("tritonep.dispatch.fp8.kept", 5.0), ("tritonep.dispatch.fp8", 30.0),
             ("tritonep.combine.push.bf16", 11.0))]
    lines = same_bytes_lines(made + ours)
    assert lines == [
        "p tritonep.dispatch.bf16 [table]: 1.20x the same bytes moved by torch (12 / 10 us, torch.same_bytes.dispatch.bf16)",
        "p tritonep.dispatch.bf16 [table]: 1.20x torch's fill of its written bytes alone (12 / 10 us, "
        "torch.same_bytes.writes.dispatch.bf16)",
        "p tritonep.dispatch.fp8.kept [table]: 0.50x the same bytes moved by torch (5 / 10 us, "
        "torch.same_bytes.dispatch.fp8.kept)",
        "p tritonep.dispatch.fp8.kept [table]: 0.50x torch's fill of its written bytes alone (5 / 10 us, "
        "torch.same_bytes.writes.dispatch.fp8.kept)",
        "p tritonep.combine.push.bf16 [table]: 1.10x the same bytes moved by torch (11 / 10 us, "
        "torch.same_bytes.combine.bf16)"]
    # a reference whose check failed prices nothing
    made[0]["checked"] = False
    assert not any("dispatch.bf16 [" in ln and "moved by torch" in ln for ln in same_bytes_lines(made + ours))
    made[1]["checked"] = False
    assert not any("dispatch.bf16 [" in ln for ln in same_bytes_lines(made + ours))


def test_a_wrong_gather_fails_its_check(monkeypatch):
    import tritonep.bench.same_bytes as sb

    T, E, K, H = 16, 8, 2, 128
    idx, _ = _routing(T, E, K)
    x = torch.randn(T, H).to(torch.bfloat16)
    rows = []

    def row(name, us, mode, extra=None):
        rows.append(dict(op=name, us=us, mode=mode, **(extra or {})))
        return rows[-1]

    monkeypatch.setattr(sb.torch, "index_select", lambda t, d, i, out: out.zero_())  # a gather that writes zeros
    made = sb.same_bytes_points(row, x, idx, ["bf16"], lambda fn: (fn(), (1.0, "cpu"))[1])
    assert not made[0]["checked"] and "x" in made[0]["check_error"]
    assert made[1]["op"] == "torch.same_bytes.writes.dispatch.bf16" and made[1]["checked"]


def test_a_fill_that_misses_bytes_fails_its_check(monkeypatch):
    """The writes reference is checked too: a fill that never ran (the zeroed rows) fails, the fill passes."""
    import tritonep.bench.same_bytes as sb

    rows = []

    def row(name, us, mode, extra=None):
        rows.append(dict(op=name, us=us, mode=mode, **(extra or {})))
        return rows[-1]

    outs = (torch.empty(6, 32, dtype=torch.bfloat16), torch.empty(6, 2, dtype=torch.float32))
    assert sb._writes(row, "dispatch.x", outs, lambda fn: (fn(), (1.0, "cpu"))[1], 0, {})["checked"]
    r = sb._writes(row, "dispatch.x", outs, lambda fn: (1.0, "cpu"), 0, {})  # the fill never ran
    assert not r["checked"] and "out0" in r["check_error"]


def _world1_rows(group):
    from tritonep.bench.ep import bench_ep

    return bench_ep(group, "cpu-smoke", wires=("bf16", "fp8"), baselines=False, same_bytes=True, iters=1)


def test_bench_ep_world1_prices_its_rows():
    """A 1-rank world's bench_ep adds the same-bytes rows beside tritonep's, all checked, and the summary pairs them."""
    from tritonep.testing.world import run_cpu_world

    rows = run_cpu_world(1, _world1_rows, timeout_s=600)[0]
    ops = [r["op"] for r in rows]
    assert {"torch.same_bytes.dispatch.bf16", "torch.same_bytes.dispatch.fp8.kept",
            "torch.same_bytes.combine.bf16"} <= set(ops), ops
    assert all(r["checked"] for r in rows), [r for r in rows if not r["checked"]]
    graph = [dict(r, mode="graph") for r in rows]  # the CPU times are mode "cpu"; the pairing reads graph rows
    lines = same_bytes_lines(graph)
    assert any(ln.startswith("cpu-smoke tritonep.dispatch.bf16 ") for ln in lines), lines
    assert any(ln.startswith("cpu-smoke tritonep.dispatch.fp8.kept ") for ln in lines), lines
