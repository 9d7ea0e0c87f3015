"""GPU (world 1): the nccl backend's pinned plan vector is never rewritten under a pending copy.

The dispatch copies its host plan (layout, ``num_tokens_per_expert``, ``expert_offsets``, counts) from one pinned
host vector to a fresh device tensor asynchronously; the next dispatch rewrites the vector after its own host read.
Back-to-back dispatches with different routing, alternating between the default stream and a side stream, must each
return exactly what the same dispatch returns alone (after a full synchronisation).
"""

import pytest
import torch


def _calls(group):
    import tritonep as tep

    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, T, K = 64, 256, 96, 4
    buf = tep.EPBuffer(group, E, H, T, K, backend="nccl")
    gen = torch.Generator().manual_seed(3)
    routings = []
    for i in range(4):  # different loads per call: every plan vector differs
        logits = torch.randn(T, E, generator=gen) + torch.linspace(0, 4 * i, E)
        idx = logits.topk(K, dim=1).indices
        routings.append((torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev), idx.to(dev),
                         torch.softmax(logits.gather(1, idx), 1).to(dev)))

    def fields(d):
        return [d.x.clone(), d.num_tokens_per_expert.clone(), d.expert_offsets.clone(), d.weights.clone(),
                d.handle.counts.clone()]

    alone = []
    for x, idx, w in routings:
        d = buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        alone.append([t.cpu() for t in fields(d)])
    side = torch.cuda.Stream()
    got = []
    for i, (x, idx, w) in enumerate(routings * 2):  # no synchronisation between calls; every other call on `side`
        if i % 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                got.append(fields(buf.dispatch(x, idx, w)))
            torch.cuda.current_stream().wait_stream(side)
        else:
            got.append(fields(buf.dispatch(x, idx, w)))
    torch.cuda.synchronize()
    buf.close()
    return [all(torch.equal(a, b.cpu()) for a, b in zip(alone[i % 4], g)) for i, g in enumerate(got)]


@pytest.mark.world1
@pytest.mark.gpu
def test_gpu_nccl_back_to_back_dispatches_keep_their_plans(gpu_world):
    (res,) = gpu_world(1, _calls, nccl=True)
    assert all(res), res
