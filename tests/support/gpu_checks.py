"""Rank functions of the GPU test suite (module-level so spawned ranks can import them).

Each ``*_world(group, ...)`` runs on every rank of :func:`tritonep.testing.run_gpu_world` and returns CPU tensors
or plain values; the tests compare them with the reference oracles on the host.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tritonep.bench.cases import make_rank_inputs

__all__ = ["heap_peer_write_world", "ep_cases_world", "ep_graph_world", "ep_grad_world", "graph_soak_world",
           "warm_up", "capture_round_trip"]


def warm_up(buf, x, idx, w) -> None:
    """One dispatch + combine of ``buf`` on a side stream, outside capture: compiles the kernels a capture records."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        d = buf.dispatch(x, idx, w)
        buf.combine(buf.expert_out_buffer(d.x.shape[0]).copy_(d.x), d.handle)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def capture_round_trip(buf, x, idx, w, expert) -> tuple:
    """``(graph, Dispatched, expert_out, y)``: ``buf``'s dispatch of the static inputs, ``expert(rows)`` copied into
    :meth:`EPBuffer.expert_out_buffer` and the combine, captured in one CUDA graph (compile first: :func:`warm_up`)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        d = buf.dispatch(x, idx, w)
        eo = buf.expert_out_buffer()
        eo.copy_(expert(d.x))
        y = buf.combine(eo, d.handle)
    return g, d, eo, y


def heap_peer_write_world(group, epochs=3):
    """CUDA heap: every rank writes into every peer's region through pointer tables, epoch signals, 3 epochs."""
    from tritonep.memory import Region, get_heap

    import triton

    from .probe_heap import peer_wait_kernel, peer_write_kernel

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    heap = get_heap(group, dev)
    buf = heap.allocate([Region("data", (W, 8), torch.int64), Region("flags", (W,), torch.int64),
                         Region("calls", (1,), torch.int64), Region("status", (8,), torch.int64)])
    outs = []
    for _ in range(epochs):
        buf.local("calls").add_(1)
        peer_write_kernel[(1,)](buf.ptr_table("data"), buf.ptr_table("flags"), buf.local("calls"), N=8, rank=rank,
                                W=W, WB=max(2, triton.next_power_of_2(W)))
        peer_wait_kernel[(1,)](buf.local("flags"), buf.local("calls"), buf.local("status"), 5_000_000_000, W=W,
                               WB=max(2, triton.next_power_of_2(W)), HAS_TIMER=True)
        outs.append(buf.local("data").cpu())
        dist.barrier(group)
    st = buf.local("status").cpu()
    buf.close()
    return outs, st


def ep_cases_world(group, cases):
    """Run dispatch -> expert -> combine (:func:`tests.support.harness.run_call`) for every case dict (E, H, Tmax,
    K, A, T per rank, seeds, mask, kind) on this rank's GPU; per case the records of its calls."""
    from .harness import open_buffer, run_call

    rank = dist.get_rank(group)
    res = []
    for c in cases:
        buf = open_buffer(group, c)
        res.append([run_call(buf, *make_rank_inputs(rank, c["T"][rank], c["H"], c["E"], c["K"], seed=s,
                                                    mask_frac=c.get("mask", 0.1)), kind=c.get("kind"))
                    for s in c.get("seeds", [0])])
        buf.close()
    return res


def ep_graph_world(group, E, H, Tmax, K, replays, seed=0):
    """Capture dispatch + combine into one CUDA graph, replay ``replays`` times with fresh inputs copied into the
    captured tensors, and check every replay on this rank against an eager run of the same inputs."""
    import tritonep as tep

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = tep.EPBuffer(group, E, H, Tmax, K)
    ref_buf = tep.EPBuffer(group, E, H, Tmax, K)
    x0, i0, w0 = (t.to(dev) for t in make_rank_inputs(rank, Tmax, H, E, K, seed=seed))
    sx, si, sw = x0.clone(), i0.clone(), w0.clone()
    warm_up(buf, sx, si, sw)
    g, d, eo, y = capture_round_trip(buf, sx, si, sw, lambda rows: (rows.float() * 0.5 + 1.0).to(torch.bfloat16))
    bad = []
    for i in range(replays):
        x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, Tmax, H, E, K, seed=seed + 1 + i))
        sx.copy_(x)
        si.copy_(idx)
        sw.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        dr = ref_buf.dispatch(x, idx, w)
        R = dr.x.shape[0]
        eor = ref_buf.expert_out_buffer(R)
        eor.copy_((dr.x.float() * 0.5 + 1.0).to(torch.bfloat16))
        yr = ref_buf.combine(eor, dr.handle)
        ok = (torch.equal(d.x[:R], dr.x) and torch.equal(d.expert_offsets, dr.expert_offsets)
              and torch.equal(y, yr))
        if not ok:
            bad.append(i)
    buf.check()
    buf.close()
    ref_buf.close()
    return bad


def ep_grad_world(group, E, H, Tmax, K, T, seed=0):
    """dispatch -> x*0.5 -> combine, backward (:func:`tests.support.harness.run_grad_call`, grad seed 99 + rank);
    the record, for :func:`tests.support.harness.check_grads` on the host."""
    from .harness import open_buffer, run_grad_call

    rank = dist.get_rank(group)
    buf = open_buffer(group, dict(E=E, H=H, Tmax=Tmax, K=K))
    out = run_grad_call(buf, *make_rank_inputs(rank, T[rank], H, E, K, seed=seed), grad_seed=99 + rank)
    buf.close()
    return out


def _graph_soak_inputs(i, W, E, H, Tmax, K, seed, ranks=None):
    """Every rank's ``(x, topk_idx, topk_weights)`` of graph-soak replay ``i`` (host tensors, deterministic).

    Masked fraction cycles 0 / 10 / 50 / 100 % (100 %: a rank whose tokens all have no route); every 7th replay
    sends every token of every rank to experts ``0..K-1`` (all on rank 0: the worst skew the default capacity takes).
    ``ranks``: only these ranks' inputs are made (the others are None); default every rank. A rank's inputs depend
    only on (seed, replay, rank).
    """
    ins = []
    for r in range(W):
        if ranks is not None and r not in ranks:
            ins.append(None)
            continue
        x, idx, w = make_rank_inputs(r, Tmax, H, E, K, seed=seed * 100003 + i, mask_frac=(0.0, 0.1, 0.5, 1.0)[i % 4])
        if i % 7 == 3:
            idx = torch.arange(K, dtype=torch.int64).expand(Tmax, K).clone()
        ins.append((x, idx, w))
    return ins


def _soak_expert_out(xr: torch.Tensor) -> torch.Tensor:
    """The soak's stand-in expert: ``bf16(x * 0.5 - 0.25)`` row-wise (``[R, H]`` bf16 -> ``[R, H]`` bf16)."""
    return (xr.float() * 0.5 - 0.25).to(torch.bfloat16)


def graph_soak_world(group, E, H, Tmax, K, replays, seed=0, status_every=100, oracle_every=100, graph=True):
    """CUDA-graph soak: capture dispatch + combine once (``Tmax`` tokens per rank), replay ``replays`` times with
    fresh routing copied into the captured inputs (see :func:`_graph_soak_inputs`: masks 0-100 %, hot skew), and
    check EVERY replay on this rank bit for bit against an eager dispatch + combine of the same inputs on a second
    buffer (rows, counts, offsets, weights and ``y``). The eager run is graph-free (host-known shapes, its own
    symmetric memory), so a replay-only fault (a frozen epoch, a stale captured pointer, a lost signal) shows up as a
    difference; the layout, the sums and the eager path itself are checked against the host oracles
    (:func:`tritonep.reference.dispatch_reference` rows / counts / offsets / weights and
    :func:`tritonep.reference.combine_reference_partial` for ``y``, through :func:`tests.support.harness.expected`)
    on replay 0, every ``oracle_every``-th replay and
    the last one (the host oracle costs ~1.6 s per replay at the test's shape; the eager check a few ms). Every rank
    regenerates the inputs it needs from (seed, replay), so checking needs no communication. The device status word
    is read every ``status_every`` replays and at the end (a timeout there raises
    :class:`tritonep.errors.PeerTimeoutError`).

    Args:
        group: the EP group (one GPU per rank). E, H, Tmax, K: buffer configuration (alignment 1, bf16 wires).
        replays: number of graph replays. seed: input seed. status_every: replays between status reads.
        oracle_every: replays between host-oracle checks (0: only the first and the last replay).
        graph: False runs the captured calls eagerly instead (on the CPU when there is no GPU): checks this function
            itself in a CPU world.

    Returns:
        ``(replays done, [(replay id, what differed), ...])`` for this rank (empty list = every replay exact);
        ``what`` names the fields, ``eager.<field>`` for the eager check and ``oracle.<field>`` for the host oracle.
    """
    import tritonep as tep

    from .harness import diff, expected

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    on_gpu = graph or torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    buf = tep.EPBuffer(group, E, H, Tmax, K)
    ref_buf = tep.EPBuffer(group, E, H, Tmax, K)
    x0, i0, w0 = _graph_soak_inputs(0, W, E, H, Tmax, K, seed, ranks=(rank,))[rank]
    sx, si, sw = x0.to(dev), i0.to(dev), w0.to(dev)
    if graph:
        warm_up(buf, sx, si, sw)
        g, d, eo, y = capture_round_trip(buf, sx, si, sw, _soak_expert_out)
        out = dict(d=d, y=y)

        def step():
            g.replay()
    else:  # the same protocol without a graph (CPU check of this function; no replay-only faults to find)
        out = {}

        def step():
            dd = buf.dispatch(sx, si, sw)
            ee = buf.expert_out_buffer(dd.x.shape[0])
            ee.copy_(_soak_expert_out(dd.x))
            out.update(d=dd, y=buf.combine(ee, dd.handle))

    bad = []
    t_start = time.monotonic()
    for i in range(replays):
        oracle = i == 0 or i == replays - 1 or (oracle_every > 0 and i % oracle_every == 0)
        ins = _graph_soak_inputs(i, W, E, H, Tmax, K, seed, ranks=None if oracle else (rank,))
        x, idx, w = (t.to(dev) for t in ins[rank])
        sx.copy_(x)
        si.copy_(idx)
        sw.copy_(w)
        step()
        d, y = out["d"], out["y"]
        # the same inputs eagerly on the second buffer (collective: every rank, every replay)
        dr = ref_buf.dispatch(x, idx, w)
        R = dr.x.shape[0]
        eor = ref_buf.expert_out_buffer(R)
        eor.copy_(_soak_expert_out(dr.x))
        yr = ref_buf.combine(eor, dr.handle)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        got = dict(ntpe=d.num_tokens_per_expert, offs=d.expert_offsets, x=d.x[:R], w=d.weights[:R], y=y)
        eager = dict(ntpe=dr.num_tokens_per_expert, offs=dr.expert_offsets, x=dr.x, w=dr.weights, y=yr)
        what = [f"eager.{k}" for k in got if not torch.equal(got[k], eager[k])]
        if (i + 1) % status_every == 0:
            buf.check()
            ref_buf.check()
            if rank == 0:
                print(f"graph soak: {i + 1}/{replays} replays, {time.monotonic() - t_start:.1f} s, "
                      f"{len(bad)} bad so far", flush=True)
        if oracle:  # every rank's expert output is the soak expert of the reference rows
            want = expected(ins, E, fn=_soak_expert_out)[rank]
            what += [f"oracle.{k}" for k in diff(got, want, tuple(got))]
        if what:
            bad.append((i, what))
    buf.check()
    ref_buf.check()
    buf.close()
    ref_buf.close()
    return replays, bad
