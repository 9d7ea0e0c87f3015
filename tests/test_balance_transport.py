"""Virtual-expert weight push / gradient pull over the CPU symmetric heap, checked against the placement."""

import torch
import torch.distributed as dist

from tritonep.balance import place_torch
from tritonep.balance.transport import ExpertTransport, PushWeights
from tritonep.testing import run_cpu_world

H, I2 = 8, 6  # per-expert weight shape of the test


def _native(rank, L, step):
    e = torch.arange(rank * L, rank * L + L, dtype=torch.float32)
    return (e[:, None, None] * 10 + step + torch.arange(H * I2).view(1, H, I2) / 64).to(torch.bfloat16)


def _counts(step, W, E):
    g = torch.Generator().manual_seed(step)
    hot = torch.randint(0, E, (1,), generator=g).item()
    c = torch.randint(0, 20, (W, E), generator=g)
    c[:, hot] += 60 * (step % 3 + 1)  # a moving hot expert
    c[step % W] += 5  # a hot source rank
    return c


def _transport_world(group, steps, E):
    rank, W = dist.get_rank(), dist.get_world_size()
    L = E // W
    tr = ExpertTransport(group, E, {"w1": (H, I2)}, dtype=torch.bfloat16, device="cpu")
    bad = []
    for step in range(steps):
        pl = place_torch(_counts(step, W, E))
        w = _native(rank, L, step).requires_grad_(True)
        (slots,) = PushWeights.apply(tr, pl, ("w1",), w)
        etc = pl.experts_to_copy[rank]
        for s in range(L):  # every used slot holds exactly the planned expert's current weights
            e = int(etc[s])
            if e >= 0:
                owner, j = divmod(e, L)
                if not torch.equal(slots[s], _native(owner, L, step)[j]):
                    bad.append((step, s, e))
        # slot gradient: slot s on this rank contributes (rank + 1) * (s + 1)
        gs = torch.stack([torch.full((H, I2), float((rank + 1) * (s + 1))) for s in range(L)]).to(torch.bfloat16)
        (slots.float() * gs.float()).sum().backward()
        want = torch.zeros(L, H, I2)
        for j in range(L):
            e = rank * L + j
            for d in range(W):
                s = int(pl.expert_slot[e, d])
                if s >= 0 and d != rank:
                    want[j] += (d + 1) * (s + 1)
        if not torch.equal(w.grad.float(), want):
            bad.append((step, "grad"))
    tr.check()
    tr.close()
    return bad


def test_push_pull_20_steps_of_changing_skew():
    res = run_cpu_world(4, _transport_world, 20, 16, timeout_s=300)
    assert res == [[], [], [], []], res
