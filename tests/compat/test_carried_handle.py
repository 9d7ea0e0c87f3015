"""The compat Buffer's carried dispatch (the decode tiles' rows lane carries the top-k with the rows) keeps no state
in the caller's tensors: a caller that overwrites ``is_token_in_rank`` between the dispatch and its combine of
``topk_weights`` (a reused layout buffer) gets the same combined weights and rows as one that did not (DeepEP's
combine reads no ``is_token_in_rank`` either)."""

import os

import torch

from tritonep.compat import deep_ep as compat
from tritonep.testing import run_cpu_world

E, H = 4, 128


def _world(group):
    os.environ["TRITONEP_GEOMETRY"] = "bt=2,dec=3"
    rank = group.rank()
    buf = compat.Buffer(group, 0, 0, backend="triton", timeout_s=60)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, H, generator=g).bfloat16()
    idx = torch.tensor([[0, 2], [1, 3], [0, 1], [2, 3], [3, -1], [1, 2]])
    wts = torch.rand(6, 2, generator=g)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    out = []
    for overwrite in (False, True):
        mask = itr.clone()
        rx, ri, rw, _, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=mask,
                                           num_tokens_per_expert=nte, topk_idx=idx, topk_weights=wts)
        if overwrite:
            mask.fill_(True)
        y, cw, _ = buf.combine(rx, h, topk_weights=rw)
        out.append((h.carried, y, cw))
    buf.destroy()
    return out


def test_combine_reads_no_caller_mask():
    for rank, ((c0, y0, w0), (c1, y1, w1)) in enumerate(run_cpu_world(2, _world, timeout_s=300)):
        assert c0 and c1, rank
        assert torch.equal(y0, y1) and torch.equal(w0, w1), (rank, w0, w1)
