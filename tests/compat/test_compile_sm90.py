"""The DeepEP-compatible Buffer's own kernels (tritonep.compat.deep_ep.kernels: the layout, the packings and
unpackings of both ways the top-k travel, the combine's row copy, the capacity poison) compile for the GPU (sm_90),
checked without a GPU: the interpreted launches of a 2-rank CPU-world run through every normal-mode path are
recorded and each compiled offline (tests/support/compile_check.py)."""

import pytest
import torch

from tests.support.compile_check import compile_recorded, record_launches
from tritonep.testing import run_cpu_world

pytestmark = pytest.mark.compile  # CI's second step (.ci/run)


def _compat_paths(group):
    from tritonep.compat import deep_ep as compat

    rank = group.rank()
    E, K, T, H = 8, 2, 5, 128
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    recs = []
    with record_launches(recs):
        for meta_rows in (256, 0):  # the top-k as meta rows of the rows lane; in the meta lane
            buf = compat.Buffer(group, 0, 0, meta_rows_max_tokens=meta_rows)
            for worst in (0, 2 * T):  # synced; num_worst_tokens (its capacity poison launch)
                n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
                rx, ri, rw, _, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr,
                                                   num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w,
                                                   num_worst_tokens=worst)
                buf.combine(rx, h)  # the meta rows' way: the caller's rows copied into the lane by a launch
                buf.combine(rx, h, topk_weights=rw)
            buf.destroy()
    return [r for r in recs if r["module"].startswith("tritonep.compat")]


def test_compat_kernels_compile_for_sm90():
    recs = run_cpu_world(2, _compat_paths, timeout_s=300)[0]
    names = {r["name"] for r in recs}
    assert {"layout_kernel", "pack_kernel", "unpack_meta_kernel", "pack_rows_kernel", "unpack_rows_kernel",
            "copy_rows_kernel", "poison_kernel"} <= names, names
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)
