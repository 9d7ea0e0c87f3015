"""The nccl backend launches every kernel through a bound launch (:class:`tritonep.runtime.bound.BoundKernel`):
after a variant's first launch, later calls take the direct C-launcher path, and the results stay the twins' bits.

CPU: a fake GPU (``tests/backends/nccl/fake_gpu.py``) makes the direct path reachable in the interpreter; each direct call
is checked against what Triton's runner would hand the C launcher and then runs the interpreted kernel. GPU (world 1,
marked gpu): the real direct path, counted, against the torch twins of the same buffer.
"""

import pytest
import torch
import torch.distributed as dist

from tests.backends.nccl.fake_gpu import count_paths, fake_gpu
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of


def _calls(impl, x, idx, w, gy, kq=False):
    """Every call kind once (dispatch, combine, both backwards); returns the outputs as a dict of tensors."""
    o, ow, ntpe, offs, h = impl.dispatch_fwd(x, idx, w, True, keep_quantized=kq)
    res = dict(out=o, out_w=ow, ntpe=ntpe, offs=offs)
    if kq:  # the kept payload and scales: the unpack's two-source variant (no combine of quantized rows)
        res["scales"] = h.x_scales
        return res
    eo = (o.float() * 0.5).to(torch.bfloat16)
    res["y"] = impl.combine_fwd(eo, h)
    res["gx"], res["gtw"] = impl.dispatch_bwd(eo, ow, h)
    res["geo"], res["grw"] = impl.combine_bwd(gy, eo, h)
    return res


def _compare(got, want, where):
    for k in want:
        if k == "grw":  # dot products over H: the twin sums in another order (tritonep.backends.nccl.unpack); fp32
            # reordering moves a cancelling sum by ~sqrt(H) ulps of its terms, not of the result (H 7168 on the GPU:
            # 1e-5 relative failed), so the bound is relative to the largest gradient; a wrong row or weight is O(1)
            scale = float(want[k].abs().max()) if want[k].numel() else 1.0
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5 * scale, msg=f"{where} {k}")
        else:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(-1).view(torch.uint8),
                                                                 want[k].view(-1).view(torch.uint8)), (where, k)


def _fake_gpu_world(group, T, wire, kq):
    from tritonep import EPBuffer

    rank = dist.get_rank(group)
    H = 128
    x, idx, w = make_rank_inputs(rank, T[rank], H, 8, 2, seed=5, mask_frac=0.2)
    w = w.float()
    gy = torch.randn(T[rank], H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with fake_gpu() as log:
        buf = EPBuffer(group, 8, H, 16, 2, expert_alignment=4 if kq else 1, backend="nccl", device="cpu",
                       dispatch_wire=wire)
        impl = backend_of(buf)
        impl.use_triton = True
        first = _calls(impl, x, idx, w, gy, kq)
        n1, p1 = len(log), log.packed
        again = _calls(impl, x, idx, w, gy, kq)
        rounds = (log[:n1], log[n1:], log.packed - p1)
    impl.use_triton = False
    twin = _calls(impl, x, idx, w, gy, kq)
    buf.close()
    _compare(first, twin, f"rank {rank} first")
    _compare(again, twin, f"rank {rank} again")
    return rounds


@pytest.mark.parametrize("wire,kq", [("bf16", False), ("fp8", True)])
def test_nccl_bound_launches_go_direct_and_match_twins(wire, kq):
    """Round 1 compiles each variant through Triton's path (one "jit" per kernel variant); round 2 of the same calls
    launches every kernel directly (no "jit") through the packed launcher, whose bytes are the twin of exactly the
    arguments Triton's runner would hand (tests/backends/nccl/fake_gpu.py); both rounds give
    the torch twins' bits on both ranks (one without tokens)."""
    res = run_cpu_world(2, _fake_gpu_world, (12, 0), wire, kq, timeout_s=300)
    for rank, (r1, r2, packed) in enumerate(res):
        assert r2 and all(kind == "direct" for kind, _ in r2), (rank, r2)
        assert packed == len(r2), (rank, packed, r2)  # round 2: every direct launch through the packed launcher
        assert sorted(n for _, n in r2) == sorted(n for _, n in r1), (rank, r1, r2)  # same launches, every one direct
        assert {n for k, n in r1 if k == "jit"} == {n for _, n in r2}, (rank, r1)
    names = {n for _, r2, _ in res for _, n in r2}
    want = {"route_count_kernel", "route_pack_kernel", "route_unpack_kernel"}
    if not kq:
        want |= {"partials_kernel", "sum_kernel", "pack_rows_kernel", "grad_expand_kernel"}
    assert names == want, names


def _gpu_world1(group):
    from tritonep import EPBuffer

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(3)
    T, E, K, H = 512, 256, 8, 7168
    logits = torch.randn(T, E, generator=gen)
    idx = logits.topk(K, dim=1).indices
    w = torch.softmax(logits.gather(1, idx), dim=1)  # weights of the top-k first: gather takes no -1 ids
    idx[torch.rand(idx.shape, generator=gen) < 0.05] = -1
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    gy = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    x, idx, w, gy = (t.to(dev) for t in (x, idx, w, gy))
    out = {}
    with count_paths() as counts:
        buf = EPBuffer(group, E, H, T, K, backend="nccl", device=dev)
        impl = backend_of(buf)
        assert impl.use_triton
        first = _calls(impl, x, idx, w, gy)
        out["round1"] = dict(counts)
        again = _calls(impl, x, idx, w, gy)
        torch.cuda.synchronize()
        out["round2"] = {k: counts[k] - out["round1"][k] for k in counts}
    impl.use_triton = False
    twin = _calls(impl, x, idx, w, gy)
    buf.close()
    _compare({k: v.cpu() for k, v in first.items()}, {k: v.cpu() for k, v in twin.items()}, "first")
    _compare({k: v.cpu() for k, v in again.items()}, {k: v.cpu() for k, v in twin.items()}, "again")
    return out


@pytest.mark.world1
@pytest.mark.gpu
def test_gpu_nccl_world1_bound_direct_matches_twins(gpu_world):
    """One GPU, DeepSeek-V3 shape (512 tokens, H 7168, top-8 of 256): the nccl backend's 9 launches of a
    dispatch + combine + both backwards go through bound kernels; the second round is all direct C-launcher calls
    (no kernel[grid]), and both rounds equal the torch twins of the same buffer (bit for bit; weight gradients of
    the combine backward within fp32 rounding). Times nothing."""
    (res,) = gpu_world(1, _gpu_world1, nccl=True)
    assert res["round1"]["calls"] == 9 and res["round1"]["jit"] == 9, res
    assert res["round2"] == {"calls": 9, "jit": 0}, res
