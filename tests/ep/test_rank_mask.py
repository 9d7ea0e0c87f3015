"""``EPBuffer.dispatch`` with a bool rank mask as ``topk_idx`` (a buffer whose top-k is its world size): the same
rows, weights, layout, handle routing and combine, bit for bit, as the expert ids ``k * L`` where set (-1 elsewhere),
on the decode tiles (the kernel reads the mask), the two-kernel tiles and the nccl backend (the front door makes the
ids); refused by name where the top-k is not the world size.
"""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import InputError
from tritonep.testing import run_cpu_world

H = 64


def mask_world(group, backend, geometry):
    os.environ["TRITONEP_GEOMETRY"] = geometry
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    L = 2
    g = torch.Generator().manual_seed(7 + rank)
    T = 9 - 3 * rank
    x = torch.randn(T, H, generator=g).bfloat16()
    mask = torch.rand(T, W, generator=g) < 0.6
    ids = torch.where(mask, torch.arange(W, dtype=torch.int32) * L, -1)
    w = torch.rand(T, W, generator=g)
    buf = tep.EPBuffer(group, W * L, H, 16, W, device="cpu", backend=backend)
    checks = []
    for sync_free in (False, True):
        a = buf.dispatch(x, ids, w, sync_free=sync_free)
        b = buf.dispatch(x, mask, w, sync_free=sync_free)
        n = int(a.expert_offsets[-1])
        checks.append(torch.equal(a.x[:n], b.x[:n]) and torch.equal(a.weights[:n], b.weights[:n]))
        checks.append(torch.equal(a.expert_offsets, b.expert_offsets))
        checks.append(torch.equal(b.handle.topk_idx.to(torch.int64), ids.to(torch.int64)))
        eo = (b.x.float() * (rank + 2)).bfloat16()
        checks.append(torch.equal(buf.combine(eo, a.handle), buf.combine(eo, b.handle)))
    buf.close()
    return checks


@pytest.mark.parametrize("backend,geometry", [("triton", "dec=2"), ("triton", ""), ("nccl", "")],
                         ids=["decode", "two-kernel", "nccl"])
def test_rank_mask_equals_ids(backend, geometry):
    for rank, checks in enumerate(run_cpu_world(2, mask_world, backend, geometry)):
        assert all(checks), (rank, checks)


def test_rank_mask_refused_where_topk_is_not_the_world():
    def fn(group):
        buf = tep.EPBuffer(group, 8, H, 16, 3, device="cpu")
        try:
            buf.dispatch(torch.zeros(4, H, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bool),
                         torch.ones(4, 3))
            msg = ""
        except InputError as e:
            msg = str(e)
        buf.close()
        return "int32 or int64" in msg and "mask" not in msg
    assert run_cpu_world(2, fn) == [True, True]
