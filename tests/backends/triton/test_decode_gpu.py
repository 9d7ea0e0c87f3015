"""GPU checks of the one-launch decode dispatch and combine (geometry ``dec=G``).

The decode path against the two-kernel path, bit for bit (received rows, offsets, weights, combine output), eagerly
and under CUDA-graph replay, with T=0 on some ranks in several calls (the case that once deadlocked on the H200),
bf16 and fp8 wires, at each ``--gpu-world-sizes`` (ranks share a GPU when there are fewer GPUs than ranks); and the
1000-replay graph soak with the decode geometry (each replay checked against an eager call; ``soak`` marker, world
of 2). On the GPU machine::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m pytest -q -m gpu tests/backends/triton/test_decode_gpu.py  # add -m "gpu" --gpu-world-sizes 2,4 for more
"""

import pytest
import torch

from tritonep.bench.cases import experts_for, script_for

pytestmark = pytest.mark.gpu

CFG = dict(E=256, H=7168, Tmax=128, K=8)  # the decode profile of the benchmarks (EP2, DeepSeek-V3 layer)
SCRIPT = [[128, 0], [0, 128], [1, 0], [0, 0], [128, 128], [77, 3], [0, 1], [128, 0]]
GEOMETRY = "bt=1,dec=128"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("wire,geometry", [("bf16", GEOMETRY), ("bf16", "bt=2,dec=64"), ("fp8", GEOMETRY)])
def test_decode_one_launch_equals_two_kernel_path(gpu_world, gpu_world_size, wire, geometry, graphs):
    from tests.support.gpu_protocol import t_script_world

    W = gpu_world_size
    cfg = dict(CFG, E=experts_for(CFG["E"], W))
    script = script_for(SCRIPT, W)
    two = gpu_world(W, t_script_world, cfg, script, graphs, "fs=0,fe=0", wire, timeout_s=600)
    one = gpu_world(W, t_script_world, cfg, script, graphs, geometry, wire, timeout_s=600)
    for i, ts in enumerate(script):
        for r in range(W):
            for k in ("x", "offs", "w", "eo", "y"):
                assert torch.equal(one[r][i][k], two[r][i][k]), (i, ts, r, k)


@pytest.mark.soak
def test_decode_graph_soak_1000_replays(gpu_world):
    from tests.support.gpu_decode import decode_soak_world

    res = gpu_world(2, decode_soak_world, GEOMETRY, 64, 512, 128, 8, 1000, timeout_s=1200)
    assert res == [(1000, []), (1000, [])], res


def test_carried_topk_on_gpu(gpu_world, gpu_world_size):
    """The count routing carried with the rows (``dispatch(count_weights=...)``: DeepEP's ``recv_topk_idx`` /
    ``recv_topk_weights`` beside every received row) on the compiled decode kernel: synced, sync-free and refused
    calls against the twin (tests/backends/triton/test_carry.py runs the same on the CPU)."""
    from tests.backends.triton.test_carry import carry_world

    W = gpu_world_size
    Ts = [16, 0, 5, 16, 1, 9, 0, 7][:W]
    for rank, (checks, err) in enumerate(gpu_world(W, carry_world, Ts, 4 * W, 8, "", torch.int64, timeout_s=600)):
        assert all(checks), (rank, checks)
        assert err == ("InputError" if rank == 0 else "PeerInputError"), (rank, err)


@pytest.mark.parametrize("geometry", ["", "dec=0"], ids=["decode", "two-kernel"])
def test_count_routing_on_gpu(gpu_world, gpu_world_size, geometry):
    """The count routing (``dispatch(count_ids=...)``) on the compiled decode kernel (the GPU's default tiles at 16
    tokens) and the two-kernel path's counts exchange launch (``dec=0``): every rank's ``count_sums`` equal the twin's over two calls (both halves of the double-buffered
    exchange), one host read per dispatch, a bad count routing refused on every rank (tests/backends/triton/
    test_count_routing.py runs the same on the CPU)."""
    from tests.backends.triton.test_count_routing import count_world

    W = gpu_world_size
    Ts = [16, 0, 5, 16, 1, 9, 0, 7][:W]
    for rank, (got, want, err, again) in enumerate(gpu_world(W, count_world, Ts, 4 * W, 8, geometry, timeout_s=600)):
        assert got == [want, want] and again == want, (rank, got, want)
        assert err == ("InputError" if rank == 0 else "PeerInputError"), (rank, err)


@pytest.mark.parametrize("geometry", ["", "dec=0"], ids=["decode", "two-kernel"])
def test_count_routing_disagreement_on_gpu(gpu_world, gpu_world_size, geometry):
    """Ranks that pass different count routings (the last rank omits ``count_ids``; rank 1 passes another
    ``count_experts``) are refused on every rank with CountRoutingError, on the compiled decode kernel and the
    two-kernel path's counts exchange launch; a sync-free disagreement is raised by the next check; later agreeing
    calls give the twin's sums (tests/ep/test_count_agreement.py runs the same on the CPU)."""
    from tests.ep.test_count_agreement import agree_world, check_agreement

    W = gpu_world_size
    Ts = [16, 0, 5, 16, 1, 9, 0, 7][:W]
    check_agreement(gpu_world(W, agree_world, Ts, 4 * W, 8, geometry, timeout_s=600), W, 4 * W)
