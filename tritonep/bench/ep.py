"""EP benchmark rows: tritonep dispatch/combine vs the NCCL pipeline and bare all_to_all_single, same run.

Run under torchrun (one process per GPU)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 -m tritonep.cli.main bench dispatch --profile deepseek-v3 --json out.json

Every timing is the median over 3 rounds of (CUDA-event time of ``iters`` back-to-back CUDA-graph replays) / iters,
both ranks released together by a barrier before each round (a barrier per call would add the ranks' skew to
every call). Bytes: "logical" = rows this rank receives (expert-grouped, one per route)
x H x 2; "nvlink" = rows that cross to another rank (one per (token, destination rank)) x H x 2, per direction.
The NCCL pipeline is what a user would write for the same expert-grouped output: ``index_select`` pack +
``all_to_all_single`` (uneven splits) + ``index_copy_`` unpack (indices precomputed outside the timed region,
which favours NCCL); combine is the reverse (gather partials, a2a back, weighted sum). ``nccl.pipeline_full.dispatch``
is the same dispatch as a user writes it when the routing changes every call (what a dispatch call must do): the
counts all_to_all, one host read of the split sizes, the metadata and rows all_to_all and the expert grouping (a
stable sort) all inside the timed call. ``tritonep[nccl].dispatch_sync_free_onehop.bf16`` and
``..._gather.bf16`` are the nccl backend's ``sync_free=True`` dispatch (no host read: fixed per-peer packet slots,
one equal-split all_to_all) in each mode of ``TRITONEP_NCCL_SYNC_FREE`` (one-hop: the counts ride in a header slot,
1 collective + 2 launches; gather: counts all_gather + device plan, 2 collectives + 4 launches; a buffer per mode,
the variable restored), checked like the others on their real rows ``[0, expert_offsets[-1])``;
``tritonep[nccl].combine_sync_free_onehop.bf16`` is the combine on a one-hop handle (equal splits), checked bit for
bit. The summary's "nccl-backend sync-free onehop/pipeline dispatch" and "... gather/pipeline dispatch" ratios
compare them with ``nccl.pipeline.dispatch`` (the goal: <= 1 at 128 tokens).

Every point checks itself after it is timed (:mod:`tritonep.bench.check`): the output of the captured
call (graph rows; every replay rewrites its tensors) or of the last eager call is compared with the on-device
oracle built once per (profile, wire): received rows, ``num_tokens_per_expert``, ``expert_offsets`` and weights bit
for bit, the combine output bit for bit against the fixed-order reference (expert outputs are
:func:`tritonep.bench.check.bench_expert` of the received rows). The NCCL baselines are checked too (bare a2a rows
and pipeline dispatch exactly, pipeline combine within one bf16 ulp of the largest output, its sums run in atomic
order). Each row gets ``checked``; a failed point prints FAILED and the drivers exit non-zero.
Without CUDA (CPU world, interpreter) the same code runs eagerly with ``time.perf_counter`` timings: a smoke test
of the checks, not a measurement.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import envs
from ..backends.layout import layout_torch, route_rows_torch
from ..memory import group_barrier, uses_nccl
from .check import PointChecker, bench_expert, compare_close, compare_exact, kept_decoded, mark_checked
from .profiles import PROFILES

__all__ = ["PROFILES", "time_graph", "time_rounds", "peer_copy_gbps", "bench_ep", "ratio_lines"]


def _barrier(group):
    group_barrier(group, _device())  # NCCL, or gloo when ranks share a GPU


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def time_graph(fn, group, iters=30, warmup=3, capture=True):
    """Median microseconds of ``fn`` replayed from a CUDA graph (``capture=False``: eager calls); (us, mode).

    Without CUDA: one warm-up and one round of eager calls timed with ``time.perf_counter`` (mode ``"cpu"``)."""
    if not torch.cuda.is_available():
        fn()
        return time_rounds(fn, group, iters, rounds=1), "cpu"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if capture:
        mode = "graph"
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        mode = "eager"
        run = fn
    return time_rounds(run, group, iters), mode


def time_rounds(run, group, iters=30, rounds=3) -> float:
    """Median over ``rounds`` of (CUDA-event time of ``iters`` back-to-back ``run()`` calls) / iters, microseconds.

    The ranks are released together by a barrier once per round, so rank skew is paid once per round, not per call.
    """
    times = []
    for _ in range(rounds):
        _barrier(group)
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            times.append((time.perf_counter() - t0) * 1e6 / iters)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def peer_copy_gbps(group, nbytes=256 << 20):
    """Pull bandwidth from the next rank's symmetric memory (``dst.copy_(peer_view)``), GB/s."""
    from ..memory import Region, get_heap

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = get_heap(group, dev).allocate([Region("p", (nbytes,), torch.uint8)])
    src = buf.peer("p", (rank + 1) % W)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    us, _ = time_graph(lambda: dst.copy_(src), group, iters=20)
    buf.close()
    return nbytes / us / 1e3


def one_gpu_inputs(T: int, H: int, E: int, K: int, seed: int = 0):
    """The one-GPU probes' setup (``benchmarks/probes/onehop_send_probe.py``, ``.../nccl_sync_free_profile.py``, run
    under ``torchrun``): the NCCL process group (made here), the rank's device (``LOCAL_RANK``, made current) and
    one call's inputs ``x [T, H]`` bf16, ``topk_idx [T, K]`` int64 (K distinct experts of E per token), ``topk_weights
    [T, K]`` float32 from generator ``seed``. Returns ``(device, x, topk_idx, topk_weights)``."""

    dist.init_process_group("nccl")
    dev = torch.device("cuda", envs.local_rank())
    torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(seed)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    return dev, x, idx, w


def _routing(rank, T, E, K, seed, dev):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, 0 + 1, generator=g)  # placeholder, replaced below
    return idx.to(dev), w.to(dev), x


def bench_ep(group, profile: str, combine_kinds=("push", "pull"), num_sms=None, iters=30, seed=0, tokens=None,
             wires=None, baselines=True, eager=True, tiles=None, same_bytes=None):
    """All rows of one profile on this rank; returns a list of dicts (same on every rank up to timings).

    ``baselines=False`` leaves out the NCCL rows and tritonep's nccl backend (kernel-tile variant sweeps);
    ``eager=False`` leaves out the eager dispatch row; ``wires`` (default: every registered wire,
    :data:`tritonep.wire.WIRES`) the wire formats to time; ``tiles``: the buffers' kernel tiles
    (:class:`tritonep.EPBuffer`'s argument: an override string; None or "": the profile's own if it has some, else
    the table's, with TRITONEP_GEOMETRY for None); ``same_bytes`` (default: with the baselines): at world 1, also
    the rows of torch moving the same bytes (:mod:`tritonep.bench.same_bytes`).
    """
    import tritonep as tep

    p = dict(PROFILES[profile])
    if tokens:
        p["tokens"] = tokens
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = _device()
    H, E, K = p["hidden"], p["num_experts"], p["topk"]
    L = E // W
    if "trace_layer" in p:
        from ..data import load_flame_trace, split_across_ranks

        parts = split_across_ranks(*load_flame_trace(p["trace_layer"], renormalize=True), W)
        idx, w = (t.to(dev) for t in parts[rank])
        T = max(q[0].shape[0] for q in parts)
        if idx.shape[0] < T:  # static capacity is the largest share; smaller shares pad with masked tokens
            pad = T - idx.shape[0]
            idx = torch.cat([idx, torch.full((pad, K), -1, dtype=idx.dtype, device=dev)])
            w = torch.cat([w, torch.zeros(pad, K, dtype=w.dtype, device=dev)])
    else:
        T = p["tokens"]
        idx, w, _ = _routing(rank, T, E, K, seed, dev)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    chk = PointChecker(group, x, idx, w, E)
    oracle, check_dispatch, check_combine, expert_out = chk.oracle, chk.dispatch, chk.combine, chk.expert_out
    # exact layout (host) for byte counts and the NCCL pipeline
    counts_mine = torch.bincount(idx.flatten()[idx.flatten() >= 0], minlength=E).to(torch.int32)
    counts = [torch.empty_like(counts_mine) for _ in range(W)]
    dist.all_gather(counts, counts_mine, group=group)
    counts = torch.stack(counts)
    lay = layout_torch(counts.cpu(), rank)
    R = int(lay["expert_offsets"][-1])
    dest = (idx // L)
    to_rank = torch.stack([(dest == d).any(1) for d in range(W)])  # [W, T]
    send_counts = to_rank.sum(1)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    nv_rows = int(sum(send_counts[d] for d in range(W) if d != rank))
    rows = []
    logical = R * H * 2
    nvlink = nv_rows * H * 2

    def row(name, us, mode, extra=None):
        if rank == 0:
            print(f"  {profile} {name}: {us:.1f} us ({mode})", flush=True)
        r = dict(profile=profile, op=name, world_size=W, tokens=T, hidden=H, us=us, mode=mode,
                 logical_gbps=logical / us / 1e3, nvlink_gbps=nvlink / us / 1e3, recv_rows=R, nvlink_rows=nv_rows)
        if extra:
            r.update(extra)
        rows.append(r)
        return r

    # --- tritonep
    from ..wire.formats import WIRES, get_wire

    # tiles: the caller's (a --variants run's), else a profile's own (decode-1launch); sync checks: deferred, what
    # training runs eagerly (captured calls read nothing whatever the mode)
    if not tiles and p.get("geometry"):
        tiles = p["geometry"]
    if p.get("geometry"):  # a profile with its own geometry (decode-1launch): no baselines, an exactness check
        baselines = False
    if torch.cuda.is_available() and not uses_nccl(group):  # ranks sharing a GPU (gloo): no NCCL to compare with
        baselines = False
    for wire in (WIRES if wires is None else wires):
        buf = tep.EPBuffer(group, E, H, T, K, num_sms=num_sms, dispatch_wire=wire, combine_wire=wire,
                           tiles=tiles, sync_checks="deferred")
        geo = buf.tiles
        wb = {"wire": wire, "wire_nvlink_gbps_factor": get_wire(wire).row_bytes(H) / (2 * H),
              "grid": geo.grid_send, "geometry": f"bt={geo.bt},bh={geo.bh},warps={geo.num_warps},grid={geo.grid_send},"
                                                f"fs={geo.fused_send},fe={geo.fused_expand},dec={geo.decode}"}
        if geo.decode:
            from .decode_check import exact_vs_two_kernel

            wb["exact_vs_two_kernel"] = exact_vs_two_kernel(group, buf, x, idx, w, wire)
            if rank == 0 and not wb["exact_vs_two_kernel"]:
                print(f"  {profile} {wire}: FAILED: the decode path differs from the two-kernel path", flush=True)

        last = {}  # the output of the captured call (graph) or of the last eager call: what each point checks

        def disp():
            last["d"] = buf.dispatch(x, idx, w)

        us, mode = time_graph(disp, group, iters=iters)
        check_dispatch(row(f"tritonep.dispatch.{wire}", us, mode, wb), last["d"], wire)
        fmt = get_wire(wire)
        if fmt.quantized:  # what an fp8 / fp4 grouped GEMM takes: the rows stay quantized (payload + scales)
            def disp_q():
                last["q"] = buf.dispatch(x, idx, w, keep_quantized=True)

            us, mode = time_graph(disp_q, group, iters=iters)
            check_dispatch(row(f"tritonep.dispatch.{wire}.kept", us, mode, wb), kept_decoded(last["q"], wire), wire)
        d = buf.dispatch(x, idx, w)
        eo = expert_out(buf.expert_out_buffer(), d)
        for kind in (("push",) if get_wire(wire).quantized else combine_kinds):
            def comb(kind=kind):
                last["y"] = buf.combine(eo, d.handle, kind=kind)

            us, mode = time_graph(comb, group, iters=iters)
            check_combine(row(f"tritonep.combine.{kind}.{wire}", us, mode, wb), last["y"], wire)
        if wire == "bf16" and eager and x.is_cuda:
            # eager calls as training runs them: deferred sync checks (one host read per dispatch, none in combine);
            # without CUDA every point above already ran eagerly (time_graph's mode "cpu"): no second row of each
            us, mode = time_graph(disp, group, iters=iters, capture=False)
            check_dispatch(row(f"tritonep.dispatch.{wire}", us, mode, wb), last["d"], wire)
            de = buf.dispatch(x, idx, w)
            eoe = expert_out(buf.expert_out_buffer(de.x.shape[0]), de)

            def comb_eager():
                last["y"] = buf.combine(eoe, de.handle)

            us, mode = time_graph(comb_eager, group, iters=iters, capture=False)
            check_combine(row(f"tritonep.combine.{geo.combine}.{wire}", us, mode, wb), last["y"], wire)
        buf.close()
        torch.cuda.empty_cache()
    if W == 1 and (baselines if same_bytes is None else same_bytes):  # torch moving the same bytes, one op each
        from .same_bytes import same_bytes_points

        same_bytes_points(row, x, idx, WIRES if wires is None else wires,
                          lambda fn: time_graph(fn, group, iters=iters), rank)
    if not baselines:
        return rows

    # --- tritonep's nccl backend (same API; eager only: it needs host-side split sizes)
    nbuf = tep.EPBuffer(group, E, H, T, K, backend="nccl")
    last = {}

    def ndisp():
        last["d"] = nbuf.dispatch(x, idx, w)

    us, mode = time_graph(ndisp, group, iters=iters, capture=False)
    check_dispatch(row("tritonep[nccl].dispatch.bf16", us, mode), last["d"], "bf16")

    # the sync-free dispatch (no host read) in each sync-free mode (a buffer per mode); the combine on the one-hop
    # handle
    for sf_mode in ("onehop", "gather"):
        sbuf = tep.EPBuffer(group, E, H, T, K, backend="nccl", sync_free_mode=sf_mode)

        def ndisp_sf(sbuf=sbuf):
            last["d"] = sbuf.dispatch(x, idx, w, sync_free=True)

        us, mode = time_graph(ndisp_sf, group, iters=iters, capture=False)
        # checked like the others: the real rows [0, expert_offsets[-1]) bit-equal to the oracle's
        check_dispatch(row(f"tritonep[nccl].dispatch_sync_free_{sf_mode}.bf16", us, mode), last["d"], "bf16")
        if sf_mode == "onehop":
            sd = last["d"]
            seo = expert_out(torch.zeros(sd.x.shape, dtype=torch.bfloat16, device=dev), sd)

            def scomb(sbuf=sbuf, sd=sd, seo=seo):
                last["y"] = sbuf.combine(seo, sd.handle)

            us, mode = time_graph(scomb, group, iters=iters, capture=False)
            check_combine(row("tritonep[nccl].combine_sync_free_onehop.bf16", us, mode), last["y"], "bf16")
        sbuf.check()  # the sync-free calls recorded no refusal
        sbuf.close()
    nd = nbuf.dispatch(x, idx, w)
    neo = expert_out(torch.empty(nd.x.shape, dtype=torch.bfloat16, device=dev), nd)

    def ncomb():
        last["y"] = nbuf.combine(neo, nd.handle)

    us, mode = time_graph(ncomb, group, iters=iters, capture=False)
    check_combine(row("tritonep[nccl].combine.bf16", us, mode), last["y"], "bf16")
    nbuf.close()

    # --- NCCL bare all_to_all_single of the deduplicated rows
    order = torch.cat([torch.nonzero(to_rank[d]).flatten() for d in range(W)])
    send_buf = x.index_select(0, order)
    recv_buf = torch.empty(int(recv_counts.sum()), H, dtype=x.dtype, device=dev)
    sc, rc = send_counts.tolist(), recv_counts.tolist()

    us, mode = time_graph(lambda: dist.all_to_all_single(recv_buf, send_buf, rc, sc, group=group), group,
                          iters=iters, capture=False)
    to_me = ((chk.idx_all >= 0) & (chk.idx_all // L == rank)).any(-1)  # [W, T]: source tokens this rank receives
    mark_checked(row("nccl.a2a", us, mode), compare_exact(dict(rows=recv_buf), dict(rows=chk.x_all[to_me])), rank)

    # --- NCCL pipeline: pack + a2a + unpack into expert segments (and combine back)
    rows_dst = route_rows_torch(idx.cpu(), lay["send_base"]).to(dev)  # [T, K] rows on the expert rank
    meta_send = torch.cat([torch.where(dest[to_rank[d]] == d, rows_dst[to_rank[d]], -1) for d in range(W)])
    meta_recv = torch.empty(int(recv_counts.sum()), K, dtype=meta_send.dtype, device=dev)
    dist.all_to_all_single(meta_recv, meta_send, rc, sc, group=group)
    valid = meta_recv >= 0
    src_pos = torch.nonzero(valid)[:, 0]
    dst_pos = meta_recv[valid].long()
    out = torch.empty(R, H, dtype=x.dtype, device=dev)

    def nccl_dispatch():
        sb = x.index_select(0, order)
        dist.all_to_all_single(recv_buf, sb, rc, sc, group=group)
        out.index_copy_(0, dst_pos, recv_buf.index_select(0, src_pos))

    us, mode = time_graph(nccl_dispatch, group, iters=iters, capture=False)
    mark_checked(row("nccl.pipeline.dispatch", us, mode), compare_exact(dict(x=out), dict(x=oracle("bf16")[0]["x"])),
                 rank)
    # --- the same pipeline as a user writes it when the routing changes every call: destinations, the counts
    # all_to_all, one host read of the split sizes, the metadata and the rows all_to_all, the expert grouping, all
    # inside the timed call (the row above computes its layout once, outside it)
    ranks = torch.arange(W, device=dev)

    def nccl_dispatch_full():
        dest = torch.where(idx >= 0, idx // L, -1)  # [T, K] destination rank of each route
        hit = (dest[None] == ranks[:, None, None]).any(-1)  # [W, T]
        nz = torch.nonzero(hit)  # (destination, token), destination-major
        d_of, t_of = nz[:, 0], nz[:, 1]
        send_n = hit.sum(1)
        recv_n = torch.empty_like(send_n)
        dist.all_to_all_single(recv_n, send_n, group=group)
        s_l, r_l = send_n.tolist(), recv_n.tolist()  # the host read
        meta = torch.where(dest.index_select(0, t_of) == d_of[:, None], idx.index_select(0, t_of) % L, -1)
        meta_r = torch.empty(sum(r_l), K, dtype=meta.dtype, device=dev)
        dist.all_to_all_single(meta_r, meta, r_l, s_l, group=group)
        rows_r = torch.empty(sum(r_l), H, dtype=x.dtype, device=dev)
        dist.all_to_all_single(rows_r, x.index_select(0, t_of), r_l, s_l, group=group)
        ok = meta_r >= 0
        src = torch.nonzero(ok)[:, 0]  # received routes in (source rank, token, k) order
        perm = torch.argsort(meta_r[ok], stable=True)  # grouped by local expert, that order kept inside
        return rows_r.index_select(0, src.index_select(0, perm))

    us, mode = time_graph(nccl_dispatch_full, group, iters=iters, capture=False)
    mark_checked(row("nccl.pipeline_full.dispatch", us, mode),
                 compare_exact(dict(x=nccl_dispatch_full()), dict(x=oracle("bf16")[0]["x"])), rank)
    # the routes' own weights travel with the metadata, so the pipeline's combine is checkable too
    w_send = torch.cat([torch.where(dest[to_rank[d]] == d, w[to_rank[d]], 0.0) for d in range(W)])
    wrecv = torch.empty(int(recv_counts.sum()), K, dtype=w_send.dtype, device=dev)
    dist.all_to_all_single(wrecv, w_send, rc, sc, group=group)
    eo_pipe = bench_expert(out)
    back = torch.empty_like(send_buf)
    y = torch.zeros(T, H, dtype=torch.float32, device=dev)

    def nccl_combine():
        part = torch.zeros(recv_buf.shape[0], H, dtype=torch.float32, device=dev)
        part.index_add_(0, src_pos, eo_pipe.index_select(0, dst_pos).float() * wrecv[valid][:, None])
        dist.all_to_all_single(back, part.to(torch.bfloat16), sc, rc, group=group)
        y.zero_()
        y.index_add_(0, order, back.float())

    us, mode = time_graph(nccl_combine, group, iters=iters, capture=False)
    mark_checked(row("nccl.pipeline.combine", us, mode),
                 compare_close("y", y, oracle("bf16")[1].float(), 2 ** -7), rank)
    return rows



def floor_us(r: dict) -> float | None:
    """The byte floor of a world-1 tritonep dispatch / combine row: the HBM bytes it must read and write (dispatch:
    the ``[T, H]`` bf16 tokens in, one row per route out -- bf16, or payload + scales when kept quantized; combine:
    the routes' bf16 rows in, ``[T, H]`` bf16 out) at the rate the row's measured copy reaches (``peer_copy_gbps``:
    at world 1 a local ``copy_``, which reads and writes its bytes). None for other rows."""
    op, pc = r.get("op", ""), r.get("peer_copy_gbps")
    if r.get("world_size") != 1 or not pc or not op.startswith("tritonep.") or r.get("mode") != "graph":
        return None
    from ..wire.formats import get_wire

    T, H, R = r["tokens"], r["hidden"], r["recv_rows"]
    if op.startswith("tritonep.dispatch."):
        fmt = get_wire(op.split(".")[2])
        out = fmt.payload_bytes(H) + fmt.scale_bytes(H) if op.endswith(".kept") else 2 * H
        moved = T * H * 2 + R * out
    elif op.startswith("tritonep.combine."):
        moved = R * H * 2 + T * H * 2
    else:
        return None
    return moved / (2 * pc * 1e3)  # a copy of N bytes moves 2N: N / (gbps * 1e3) us reads and as much writes


def ratio_lines(rows) -> list:
    """The eager-cost ratios per profile from one rank's rows: eager / graph (tritonep dispatch and combine) and
    tritonep's nccl backend / the hand-written NCCL pipeline (dispatch and combine); at world 1 each graph row
    against its byte floor (:func:`floor_us`) and the kept-quantized dispatches against the bf16 one."""
    from .same_bytes import same_bytes_lines

    out = same_bytes_lines(rows)
    for r in rows:
        f = floor_us(r)
        if f:
            out.append(f"{r['profile']} {r['op']} [{r.get('variant') or 'table'}]: {r['us']:.0f} us = "
                       f"{r['us'] / f:.2f}x its byte floor ({f:.0f} us)")
    for r in rows:
        if r.get("op", "").endswith(".kept") and r.get("mode") == "graph":
            b = [q for q in rows if q.get("op") == "tritonep.dispatch.bf16" and q.get("mode") == "graph"
                 and q.get("profile") == r["profile"] and q.get("variant") == r.get("variant")]
            if b:
                out.append(f"{r['profile']} {r['op']} [{r.get('variant') or 'table'}]: {r['us'] / b[0]['us']:.2f}x "
                           f"the bf16 dispatch ({r['us']:.0f} / {b[0]['us']:.0f} us)")
    for prof in dict.fromkeys(r["profile"] for r in rows):
        rs = [r for r in rows if r["profile"] == prof and not r.get("variant")]

        def us(op, mode=None):
            for r in rs:
                if r["op"] == op and (mode is None or r["mode"] == mode):
                    return r["us"]
            return None

        parts = []
        for name, a, b in (("dispatch eager/graph", us("tritonep.dispatch.bf16", "eager"),
                            us("tritonep.dispatch.bf16", "graph")),
                           ("combine eager/graph", us("tritonep.combine.push.bf16", "eager")
                            or us("tritonep.combine.pull.bf16", "eager"), us("tritonep.combine.push.bf16", "graph")),
                           ("nccl-backend/pipeline dispatch", us("tritonep[nccl].dispatch.bf16"),
                            us("nccl.pipeline.dispatch")),
                           ("nccl-backend/full pipeline dispatch", us("tritonep[nccl].dispatch.bf16"),
                            us("nccl.pipeline_full.dispatch")),
                           ("nccl-backend sync-free onehop/pipeline dispatch",
                            us("tritonep[nccl].dispatch_sync_free_onehop.bf16"), us("nccl.pipeline.dispatch")),
                           ("nccl-backend sync-free gather/pipeline dispatch",
                            us("tritonep[nccl].dispatch_sync_free_gather.bf16"), us("nccl.pipeline.dispatch")),
                           ("nccl-backend/pipeline combine", us("tritonep[nccl].combine.bf16"),
                            us("nccl.pipeline.combine"))):
            if a and b:
                parts.append(f"{name} {a / b:.2f}x ({a:.0f}/{b:.0f} us)")
        if parts:
            out.append(f"{prof}: " + "; ".join(parts))
    return out
