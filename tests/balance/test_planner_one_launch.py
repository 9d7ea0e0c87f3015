"""The one-launch planner: W = 2..8 with hot/cold skews and T = 0 ranks, both modes, many chunks (the
look-back over earlier chunks), repeated calls on one persistent state, one launch per call, bounded waits."""

import pytest
import torch

from tritonep.balance import place_torch, plan, plan_status, remap_torch
from tritonep.balance import planner as planner_mod
from tritonep.errors import PlanError

from tests.balance.planner_cases import make_topk


def _skew(E, hot, cold, weight):
    """Expert probabilities: ``hot`` experts ``weight`` times as likely, ``cold`` experts never chosen."""
    p = torch.ones(E)
    p[list(hot)] = weight
    p[list(cold)] = 0.0
    return p


# (world, L, K, tokens per rank (a 0 on purpose), hot experts, cold experts)
SKEWS = [
    (2, 4, 2, [0, 23], (0, 1), (6, 7)),
    (3, 3, 2, [14, 0, 9], (8,), (0, 1, 2)),
    (4, 2, 3, [11, 0, 6, 17], (2, 3), (6, 7)),
    (5, 2, 2, [9, 12, 0, 3, 10], (9,), (0, 1, 2, 3)),
    (6, 2, 2, [0, 8, 5, 13, 0, 7], (4, 5), (10, 11)),
    (7, 1, 2, [6, 0, 11, 4, 9, 2, 5], (0,), (6,)),
    (8, 2, 3, [7, 3, 0, 12, 5, 9, 0, 8], (14, 15), (0, 1, 2, 3)),
]


@pytest.mark.parametrize("mode", ["reference", "minimal"])
@pytest.mark.parametrize("case", range(len(SKEWS)), ids=[f"W{c[0]}" for c in SKEWS])
def test_one_launch_equals_twins_w2_to_8(case, mode):
    world, L, K, tokens, hot, cold = SKEWS[case]
    E = world * L
    topks, counts = make_topk(world, E, K, tokens, probs=_skew(E, hot, cold, 30.0), mask_p=0.1, seed=case)
    p = place_torch(counts, mode)
    for r in range(world):
        want = remap_torch(topks[r], p, r, counts)
        for G, blk in ((1, 16), (4, 16)):  # one chunk; several chunks with tiles smaller than a chunk
            pt, rid = plan(counts, topks[r], r, num_programs=G, block=blk, validate=True, mode=mode)
            assert pt.equal(p), (r, G)
            assert torch.equal(rid, want), (r, G)


def test_one_launch_per_call_and_state_survives_changing_grids():
    """Each call is one launch; calls with different grids in a row all stay exact."""
    from tritonep.runtime.status import wait_bound

    topks, counts = make_topk(4, 8, 2, [10, 0, 7, 15], probs=_skew(8, (1,), (5,), 20.0), seed=4)
    p = place_torch(counts)
    want = remap_torch(topks[3], p, 3, counts)
    wait_bound(torch.device("cpu"))  # the interpreter's poll calibration (its own launch) runs once, not counted
    calls = []
    from triton.runtime.interpreter import InterpretedFunction

    orig = InterpretedFunction.run

    def counting(self, *a, **kw):
        calls.append(getattr(self.fn, "__name__", "?"))
        return orig(self, *a, **kw)

    InterpretedFunction.run = counting
    try:
        for G in (1, 3, 2, 70, 5):  # 70 chunks: more flags than the first call (the state does not move)
            pt, rid = plan(counts, topks[3], 3, num_programs=G, block=16, validate=True)
            assert pt.equal(p) and torch.equal(rid, want), G
    finally:
        InterpretedFunction.run = orig
    assert calls == ["plan_kernel"] * 5
    sync = planner_mod._SYNC["cpu"]
    assert int(sync[0]) & 0xFFFFFFFF == 0, "arrivals reset by the last program of every call"


def test_num_programs_bounds():
    counts = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(PlanError, match="num_programs=0"):
        plan(counts, torch.empty(0, 1, dtype=torch.int64), 0, num_programs=0)
    with pytest.raises(PlanError, match="num_programs=257"):
        plan(counts, torch.empty(0, 1, dtype=torch.int64), 0, num_programs=257)


def test_wait_that_never_ends_is_bounded():
    """A chunk whose placement never arrives gives up after the bound: status bit 8, its valid routes become 2E
    (refused by the dispatch), masked routes stay -1. Made by launching the kernel with one arrival already
    counted, so no program takes the placement role."""
    from tritonep.balance.planner import _pow2
    from tritonep.balance.kernels.planner import plan_kernel

    W, L, K, E = 2, 2, 2, 4
    topk = torch.tensor([[0, 3], [1, -1], [2, 0]], dtype=torch.int64)
    counts = torch.tensor([[2, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.int32)
    i32 = dict(dtype=torch.int32)
    out = torch.full((6,), 123, **i32)
    status = torch.zeros(2, **i32)
    state = torch.zeros(1 + 8, dtype=torch.int64)
    state[0] = (7 << 32) | 1  # call 7, one arrival already counted: the only program takes role 1 (chunk 0)
    big = [torch.empty(E, W, **i32) for _ in range(3)]
    plan_kernel[(1,)](counts, counts.stride(0), counts.stride(1), topk, topk.stride(0), topk.stride(1), 6, 8, 1,
                      torch.empty(1, _pow2(E), **i32), torch.empty(1, _pow2(E), **i32), big[0],
                      torch.empty(W, L, **i32), big[1], big[2], torch.empty(W, W, **i32), torch.empty(W, **i32),
                      out, status, state[:1], state[1:], 50, 0,
                      W=W, L=L, K=K, W_PAD=2, L_PAD=2, E_PAD=4, BLOCK=16, CB=16, RB=2, CH=4, FB=2, HAS_TIMER=False)
    assert status.tolist() == [0, 8]
    assert out.tolist() == [8, 8, 8, -1, 8, 8]
    assert int(state[1 + 1]) == 8, "its own chunk histogram was still published"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reference", "minimal"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_gpu_one_launch_graph_replays(world, mode):
    """DeepSeek-V3 size (4096 tokens x top-8, 256 experts), OLMoE skew, a rank with T = 0 among them: eager calls
    and 50 CUDA-graph replays (flags never reset) all equal the twins; interleaved eager calls stay exact."""
    from tritonep.data import load_olmoe_histogram, sample_routing, scale_histogram_to_experts

    E, K, T = 256, 8, 4096
    hist = scale_histogram_to_experts(load_olmoe_histogram("arxiv", 0), E)
    idxs = [sample_routing(hist, T, K, generator=r)[0] if r != 1 else torch.empty(0, K, dtype=torch.int64)
            for r in range(world)]
    counts = torch.stack([torch.bincount(i[i >= 0].reshape(-1), minlength=E) for i in idxs]).to(torch.int32)
    p = place_torch(counts, mode)
    dev_counts = counts.cuda()
    for r in (0, 1):
        idx = idxs[r].cuda().to(torch.int32)
        want = remap_torch(idxs[r], p, r, counts)
        pt, rid = plan(dev_counts, idx, r, validate=True, mode=mode)
        assert pt.equal(p) and torch.equal(rid.cpu(), want)
        from tritonep.bench.planner import _count_launches

        assert _count_launches(lambda: plan(dev_counts, idx, r, mode=mode)) == 1  # CUDA kernels (torch.profiler)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            plan(dev_counts, idx, r, mode=mode)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gp, grid_out = plan(dev_counts, idx, r, mode=mode)
        for i in range(50):
            grid_out.fill_(-7)
            g.replay()
            if i % 10 == 0:
                pe, re = plan(dev_counts, idx, r, mode=mode)
                assert pe.equal(p) and torch.equal(re.cpu(), want), (r, i)
            torch.cuda.synchronize()
            assert plan_status(gp) == 0 and gp.equal(p) and torch.equal(grid_out.cpu(), want), (r, i)


# (world, L, K, tokens per rank, num_programs, lookback_group, num_warps, block): two-level look-back with groups
# of 1, 2, 3 and G chunks, the default ceil(sqrt(G)), and chunks longer than one pass-(C) tile (the C loop)
LOOKBACK = [
    (2, 4, 3, [60, 0], 1, None, None, 16),   # 180 routes in one chunk: pass (C) runs 3 tiles of 64
    (3, 2, 2, [0, 40, 25], 7, 1, None, 16),  # every chunk its own group
    (4, 2, 3, [19, 0, 33, 8], 5, 2, 4, 16),
    (5, 2, 2, [31, 12, 0, 3, 10], 6, 3, 2, 16),
    (8, 2, 3, [7, 13, 0, 41, 5, 9, 0, 8], 7, None, None, 16),
    (8, 1, 2, [12, 0, 50, 4, 9, 2, 5, 30], 3, 3, 8, 32),  # one group holds every chunk
]


@pytest.mark.parametrize("mode", ["reference", "minimal"])
@pytest.mark.parametrize("case", range(len(LOOKBACK)), ids=[f"W{c[0]}G{c[4]}" for c in LOOKBACK])
def test_two_level_lookback_and_remap_tiles_equal_twins(case, mode):
    world, L, K, tokens, G, group, warps, blk = LOOKBACK[case]
    E = world * L
    topks, counts = make_topk(world, E, K, tokens, probs=_skew(E, (E - 1, 0), (1,), 25.0), mask_p=0.15, seed=40 + case)
    p = place_torch(counts, mode)
    for r in range(world):
        want = remap_torch(topks[r], p, r, counts)
        pt, rid = plan(counts, topks[r], r, num_programs=G, block=blk, validate=True, mode=mode, num_warps=warps,
                       lookback_group=group)
        assert pt.equal(p), (r, G, group)
        assert torch.equal(rid, want), (r, G, group)


def test_launch_config_lookback_and_remap_tile():
    """The default look-back group is ceil(sqrt(G)); the longest look-back sums far fewer rows than G - 1; the
    pass-(C) tile covers a whole default GPU chunk at W = 2..8 (so its loads all happen before the placement wait)."""
    from tritonep.balance.planner import _launch_config

    for W in (2, 4, 8):
        cfg = _launch_config(W, 256, 4096 * 8, None, None, None, True, None)
        assert (cfg["num_programs"], cfg["group"], cfg["num_groups"], cfg["chunk"]) == (128, 12, 11, 256)
        assert cfg["CB"] == cfg["chunk"] and cfg["FB"] >= max(cfg["group"], cfg["num_groups"])
        assert (cfg["group"] - 1) + (cfg["num_groups"] - 1) == 21  # rows summed by the last chunk, was 127
    assert _launch_config(2, 8, 100, 9, 16, None, False, None)["group"] == 3
    assert _launch_config(2, 8, 100, 1, 16, None, False, None)["group"] == 1
    with pytest.raises(PlanError, match="num_warps=3"):
        _launch_config(2, 8, 100, 4, 16, 3, False, None)
    with pytest.raises(PlanError, match="lookback_group=0"):
        _launch_config(2, 8, 100, 4, 16, None, False, 0)


def test_group_total_that_never_arrives_is_bounded():
    """A chunk of look-back group 1 whose group-0 total never arrives (group 0's last chunk gave up on a missing
    group mate, so it publishes no total) gives up after the bound: status 8, its valid routes 2E, masked -1;
    the placement flag itself is there (pre-set), so the group-total wait is the one that fails. Made by
    launching with two arrivals already counted: chunk 0 never runs."""
    from tritonep.balance.kernels.planner import plan_kernel

    W, L, K, E, T = 2, 2, 2, 4, 8
    topk = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, -1], [2, 1], [3, 3], [1, 2]], dtype=torch.int64)
    counts = torch.stack([torch.bincount(topk[topk >= 0], minlength=E), torch.zeros(E, dtype=torch.int64)])
    counts = counts.to(torch.int32)
    p = place_torch(counts)
    i32 = dict(dtype=torch.int32)
    G, group, chunk = 4, 2, 4
    out = torch.full((T * K,), 123, **i32)
    status = torch.zeros(G + 1, **i32)
    state = torch.zeros(1 + 8, dtype=torch.int64)
    state[0] = (7 << 32) | 2  # call 7, two arrivals counted: roles 2, 3, 4 (chunks 1, 2, 3), then call 8 restarts
    state[1] = 8  # the placement flag of call 7, as if its placement had been published
    plan_kernel[(G + 1,)](counts, counts.stride(0), counts.stride(1), topk, topk.stride(0), topk.stride(1), T * K,
                          chunk, group, torch.zeros(G, 4, **i32), torch.zeros(2, 4, **i32),
                          p.allocation.clone(), p.experts_to_copy.clone(), p.expert_slot.clone(),
                          p.segment_ends.clone(), p.quota.clone(), p.capacity.clone(), out, status, state[:1],
                          state[1:], 50, 0, W=W, L=L, K=K, W_PAD=2, L_PAD=2, E_PAD=4, BLOCK=16, CB=16, RB=2, CH=4,
                          FB=2, HAS_TIMER=False)
    assert status[2] == 8 and status[3] == 8 and status[4] & 8, status.tolist()  # chunk 1: mate; 2, 3: total
    assert out[8:12].tolist() == [2 * E, -1, 2 * E, 2 * E]
    assert int(state[1 + G + 1]) != 8, "group 0's total was not published by a chunk that gave up"


@pytest.mark.compile
def test_planner_variants_compile_for_sm90():
    """Every new launch shape compiles for sm_90 offline (the interpreter accepts code the compiler refuses):
    one-level and two-level look-back, a chunk longer than one pass-(C) tile, 1 / 2 / 4 warps, both modes."""
    from tests.support.compile_check import compile_recorded, record_launches

    topks, counts = make_topk(4, 8, 3, [40, 0, 9, 12], probs=_skew(8, (0,), (5,), 20.0), mask_p=0.1, seed=9)
    recs = []
    with record_launches(recs):
        for mode, G, group, warps, blk in (("reference", 1, None, None, 16), ("minimal", 5, 2, 4, 16),
                                           ("reference", 6, 3, 2, 32)):
            plan(counts, topks[0], 0, num_programs=G, block=blk, mode=mode, num_warps=warps, lookback_group=group)
    assert {r.get("name") for r in recs} == {"plan_kernel"} and len(recs) == 3
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


def test_sync_state_never_moves():
    """The planner's persistent state (call number + flags) is made once at the size of the largest launch
    (MAX_PLAN_PROGRAMS chunks in groups of 1): a CUDA graph captured around a small plan() keeps its pointer valid
    when a later plan() needs more flags (a regrown state freed the captured one: replays then wrote into memory
    the caching allocator had handed to other tensors)."""
    topks, counts = make_topk(2, 4, 2, [3, 40], mask_p=0.1, seed=12)
    p = place_torch(counts)
    want = remap_torch(topks[1], p, 1, counts)
    ptrs = set()
    for G, group in ((1, None), (70, 1), (5, 2)):  # 70 chunks in groups of 1: 1 + 70 + 70 flags
        pt, rid = plan(counts, topks[1], 1, num_programs=G, block=16, lookback_group=group)
        assert pt.equal(p) and torch.equal(rid, want), G
        ptrs.add(planner_mod._SYNC["cpu"].data_ptr())
    assert len(ptrs) == 1, "the persistent state moved"
    assert planner_mod._SYNC["cpu"].numel() >= 1 + 2 * planner_mod.MAX_PLAN_PROGRAMS + 1


@pytest.mark.gpu
def test_gpu_graph_of_small_plan_survives_a_larger_eager_plan():
    """A graph captured around a small plan() (G = 2) replays exactly after an eager plan() that needs more flags
    (G = 200 in groups of 1: 401 flags); a regrown state freed the captured one (use after free on replay)."""
    topks, counts = make_topk(2, 8, 2, [30, 200], mask_p=0.1, seed=13)
    p = place_torch(counts)
    dev_counts = counts.cuda()
    idx = topks[1].cuda()
    want = remap_torch(topks[1], p, 1, counts)
    plan(dev_counts, idx, 1, num_programs=2)  # warm-up outside the capture (makes the state)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gp, grid_out = plan(dev_counts, idx, 1, num_programs=2)
    pe, re = plan(dev_counts, idx, 1, num_programs=200, block=16, lookback_group=1)
    assert pe.equal(p) and torch.equal(re.cpu(), want)
    junk = [torch.full((66,), -1, dtype=torch.int64, device="cuda") for _ in range(64)]  # the old state's size
    for i in range(20):
        grid_out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        assert plan_status(gp) == 0 and gp.equal(p) and torch.equal(grid_out.cpu(), want), i
    assert all(int(j.min()) == -1 and int(j.max()) == -1 for j in junk), "a replay wrote into freed memory"
