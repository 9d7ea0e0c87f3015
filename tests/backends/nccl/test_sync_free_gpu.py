"""GPU (world 1, NCCL): the nccl backend's sync-free dispatch makes no host sync and replays in a CUDA graph.

Under ``torch.cuda.set_sync_debug_mode("error")`` a sync-free dispatch + combine raises on any host sync; the same
pair captured in one CUDA graph (NCCL collectives captured) replays bit-equal to the synced dispatch's real rows and
combine. Both sync-free modes (``TRITONEP_NCCL_SYNC_FREE`` = ``gather`` / ``onehop``).
"""

import os

import pytest
import torch
from tests.support.hooks import backend_of

MODES = ("gather", "onehop")


def _buffer(group, mode, *args):
    """An nccl EPBuffer whose sync-free mode is ``mode`` (the variable set for its construction only)."""
    import tritonep as tep

    os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode
    try:
        buf = tep.EPBuffer(group, *args, backend="nccl")
    finally:
        os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
    assert backend_of(buf).sync_free_mode == mode
    return buf


def _body(group, mode):
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, T, K = 64, 256, 128, 4
    buf = _buffer(group, mode, E, H, T, K)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(T, E, generator=gen)
    idx = logits.topk(K, dim=1).indices.to(dev)
    w = torch.softmax(logits.topk(K, dim=1).values, 1).to(dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    d = buf.dispatch(x, idx, w)
    R = d.x.shape[0]
    eo = buf.expert_out_buffer()
    eo[:R].copy_((d.x.float() * 0.5).to(torch.bfloat16))
    ref = [d.x.clone(), d.weights.clone(), d.expert_offsets.clone(), buf.combine(eo, d.handle).clone()]

    def step():
        f = buf.dispatch(x, idx, w, sync_free=True)
        eo.copy_((f.x.float() * 0.5).to(torch.bfloat16))
        return f, buf.combine(eo, f.handle)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: compiles, persistent slots, allocator pools
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
        try:
            f, y = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        eager = [f.x[:R].clone(), f.weights[:R].clone(), f.expert_offsets.clone(), y.clone()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            fg, yg = step()
        graph.replay()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    replay = [fg.x[:R].clone(), fg.weights[:R].clone(), fg.expert_offsets.clone(), yg.clone()]
    buf.check()
    buf.close()
    return [torch.equal(a, b) for a, b in zip(ref, eager)] + [torch.equal(a, b) for a, b in zip(ref, replay)]


@pytest.mark.world1
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_nccl_sync_free_no_host_sync_and_graph_replay(gpu_world, mode):
    (res,) = gpu_world(1, _body, mode, nccl=True)
    assert all(res), res


def _replays(group, mode):
    """Eager sync-free == synced (real rows, weights, counts, zero tail, combine); then dispatch + expert + combine
    captured once and replayed on three new routings written into the captured inputs, each equal to the synced
    calls on that routing."""
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, T, K = 64, 256, 96, 4
    buf = _buffer(group, mode, E, H, T, K)
    gen = torch.Generator().manual_seed(5)

    def routing(i):
        logits = torch.randn(T, E, generator=gen) + torch.linspace(0, 3 * i, E)
        idx = logits.topk(K, dim=1).indices
        idx[::7, 1] = -1  # masked routes
        return (torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev), idx.to(dev),
                torch.softmax(logits.gather(1, idx.clamp(min=0)), 1).to(dev))

    def expert(rows):
        return (rows.float() * 0.5 + 1).to(torch.bfloat16)

    def synced(x, idx, w):
        d = buf.dispatch(x, idx, w)
        R = d.x.shape[0]
        eo = buf.expert_out_buffer(R)
        eo[:R].copy_(expert(d.x))
        y = buf.combine(eo, d.handle)
        return [t.clone() for t in (d.x, d.weights, d.num_tokens_per_expert, d.expert_offsets, y)]

    def check(free, ref):
        rows, w, ntpe, offs, y = free
        rx, rw, rn, ro, ry = ref
        end = int(offs[-1])
        return dict(rows=torch.equal(rows[:end], rx), w=torch.equal(w[:end], rw), tail=bool((w[end:] == 0).all()),
                    ntpe=torch.equal(ntpe, rn), offs=torch.equal(offs, ro), y=torch.equal(y, ry))

    out = {}
    x, idx, w = routing(0)
    ref = synced(x, idx, w)
    d = buf.dispatch(x, idx, w, sync_free=True)
    eo = buf.expert_out_buffer()
    eo.copy_(expert(d.x))
    y = buf.combine(eo, d.handle)
    torch.cuda.synchronize()
    out["eager"] = check([d.x, d.weights, d.num_tokens_per_expert, d.expert_offsets, y], ref)
    # capture dispatch + expert + combine once, replay on new routing copied into the static inputs
    sx, sidx, sw = x.clone(), idx.clone(), w.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm the captured path on the capture stream
        dd = buf.dispatch(sx, sidx, sw, sync_free=True)
        eo.copy_(expert(dd.x))
        buf.combine(eo, dd.handle)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gd = buf.dispatch(sx, sidx, sw, sync_free=True)
        eo.copy_(expert(gd.x))
        gy = buf.combine(eo, gd.handle)
    for i in (1, 2, 3):
        x, idx, w = routing(i)
        ref = synced(x, idx, w)
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        out[f"replay{i}"] = check([gd.x, gd.weights, gd.num_tokens_per_expert, gd.expert_offsets, gy], ref)
    buf.check()  # nothing refused
    buf.close()
    return out


@pytest.mark.world1
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_nccl_sync_free_eager_and_captured(gpu_world, mode):
    (res,) = gpu_world(1, _replays, mode, nccl=True)
    bad = {k: v for k, v in res.items() if not all(v.values())}
    assert not bad, bad
