"""The triton backend's launches on the direct path (:class:`tritonep.runtime.bound.BoundKernel`), on the CPU.

A fake GPU (``tests/backends/nccl/fake_gpu.py``) makes the direct C-launcher path reachable in the interpreter: each direct
call is checked against what Triton's runner would hand the C launcher (grid, every pointer as an int in parameter
order, the variant Triton's binder picks) and then runs the interpreted kernel. The handle's fields reach the kernels
as :class:`tritonep.runtime.field_view.FieldView` addresses (no tensor views per call): round 1 binds every variant
through Triton's path (tensors materialised), round 2 launches every kernel directly from the addresses, and both
rounds give the bits of the same calls on a buffer that never took the direct path.
"""

import pytest
import torch
import torch.distributed as dist

from tests.backends.nccl.fake_gpu import fake_gpu
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of


def _calls(buf, x, idx, w, gy):
    """Dispatch, combine and both backwards once; the outputs as a dict of tensors."""
    impl = backend_of(buf)
    o, ow, ntpe, offs, h = impl.dispatch_fwd(x, idx, w, True)
    eo = buf.expert_out_buffer()
    eo[:o.shape[0]] = (o.float() * 0.5).to(torch.bfloat16)
    res = dict(out=o.clone(), out_w=ow.clone(), ntpe=ntpe.clone(), offs=offs.clone(), rows=h.rows.clone(),
               counts=h.counts.clone())
    res["y"] = impl.combine_fwd(eo, h)
    res["gx"], res["gtw"] = impl.dispatch_bwd(eo, ow, h)
    res["geo"], res["grw"] = impl.combine_bwd(gy, eo, h)
    return res


def _world(group, T, geometry, packed="1"):
    import os

    from tritonep import EPBuffer

    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    os.environ["TRITONEP_PACKED_LAUNCH"] = packed
    rank = dist.get_rank(group)
    H = 64
    x, idx, w = make_rank_inputs(rank, T[rank], H, 8, 2, seed=7, mask_frac=0.2)
    w = w.float().contiguous()
    gy = torch.randn(T[rank], H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    plain = EPBuffer(group, 8, H, 16, 2, device="cpu")
    want = _calls(plain, x, idx, w, gy)
    plain.close()
    with fake_gpu() as log:
        buf = EPBuffer(group, 8, H, 16, 2, device="cpu")
        rounds, packed = [], []
        for _ in range(2):
            n, p0 = len(log), log.packed
            got = _calls(buf, x, idx, w, gy)
            rounds.append(log[n:])
            packed.append(log.packed - p0)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8),
                                                                     want[k].view(torch.uint8)), (rank, k)
        buf.close()
    return rounds, packed


@pytest.mark.parametrize("geometry,kernels", [
    ("", {"chunk_hist_kernel", "exchange_kernel", "dispatch_send_kernel", "dispatch_expand_kernel",
          "combine_partial_kernel", "combine_out_kernel"}),
    ("fs=1,fe=1,fc=1", {"chunk_hist_kernel", "exchange_kernel", "dispatch_fused_kernel", "combine_fused_kernel",
                        "combine_partial_kernel", "combine_out_kernel", "dispatch_send_kernel",
                        "dispatch_expand_kernel"}),
    # decode: the combine and the dispatch backward are both the decode combine (weighted / unweighted + wgrad)
    ("dec=2", {"dispatch_decode_kernel", "combine_decode_kernel", "dispatch_send_kernel", "dispatch_expand_kernel"})],
    ids=["two-kernel", "fused", "decode"])
@pytest.mark.parametrize("packed", ["1", "0"], ids=["packed", "triton-launcher"])
def test_triton_backend_launches_direct_from_field_addresses(geometry, kernels, packed):
    """Round 2's direct launches go through the packed launcher (its bytes checked against the twin of each
    launch, tests/backends/nccl/fake_gpu.py) or, with TRITONEP_PACKED_LAUNCH=0, through Triton's C launcher."""
    res = run_cpu_world(2, _world, (12, 5), geometry, packed, timeout_s=300)
    assert {n for _, n in res[0][0][1]} == kernels  # each geometry's kernels (the backwards: send, expand, partial, out)
    for rank, ((r1, r2), (p1, p2)) in enumerate(res):
        assert p2 == (len(r2) if packed == "1" else 0), (rank, p2, r2)  # every direct launch packed, or none
        assert "stale" not in {k for k, _ in r1 + r2}, (rank, r1, r2)
        assert r2 and all(k == "direct" for k, _ in r2), (rank, r2)  # round 2: every launch direct
        assert sorted(n for _, n in r2) == sorted(n for _, n in r1), (rank, r1, r2)
        assert {n for k, n in r1 if k == "jit"} == {n for _, n in r2}, (rank, r1)


def _gpu_first_call(group, T):
    from tests.backends.nccl.fake_gpu import count_paths
    from tests.support.harness import expected, make_calls, open_buffer, run_call

    cfg = dict(E=256, H=7168, Tmax=T, K=8, backend="triton")
    (c,) = make_calls(1, cfg, [T], [11])[0]
    with count_paths() as counts:
        buf = open_buffer(group, cfg)  # construction's dry run compiles AND binds every variant
        first = run_call(buf, *c)
        torch.cuda.synchronize()
        n1 = dict(counts)
        again = run_call(buf, *c)
        torch.cuda.synchronize()
    buf.close()
    want = expected([c], cfg["E"], eos=[first["eo"]])[0]
    return dict(first=n1, both=dict(counts), bad=[f for f in ("x", "w", "ntpe", "offs", "counts", "y")
                                                  if not torch.equal(first[f].cpu(), want[f])],
                same=all(torch.equal(first[f], again[f]) for f in ("x", "w", "y")))


@pytest.mark.world1
@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 4096])
def test_gpu_fresh_buffer_first_call_is_direct(gpu_world, T):
    """One GPU, DeepSeek-V3 shape: the FIRST dispatch + combine of a fresh buffer launches every kernel on the
    direct path (the dry run bound what it compiled: no kernel[grid]), equals the reference bit for bit, and the
    second call gives the same bits. Times nothing."""
    (res,) = gpu_world(1, _gpu_first_call, T)
    assert res["first"]["calls"] > 0 and res["first"]["jit"] == 0, res
    assert res["both"]["jit"] == 0 and not res["bad"] and res["same"], res
