"""GPU (world 1, NCCL): the nccl backend's sync-free dispatch makes no host sync and replays in a CUDA graph.

Written on a CPU-only host (session 9): NOT yet run on a GPU. Under ``torch.cuda.set_sync_debug_mode("error")`` a
sync-free dispatch + combine raises on any host sync; the same pair captured in one CUDA graph (NCCL collectives
captured) replays bit-equal to the synced dispatch's real rows and combine.
"""

import pytest
import torch


def _body(group):
    import tritonep as tep

    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, T, K = 64, 256, 128, 4
    buf = tep.EPBuffer(group, E, H, T, K, backend="nccl")
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
def test_gpu_nccl_sync_free_no_host_sync_and_graph_replay(gpu_world):
    (res,) = gpu_world(1, _body, nccl=True)
    assert all(res), res
