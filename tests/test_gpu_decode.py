"""GPU checks of the one-launch decode dispatch and combine (geometry ``dec=G``) on 2 GPUs.

The decode path against the two-kernel path, bit for bit (received rows, offsets, weights, combine output), eagerly
and under CUDA-graph replay, with T=0 on one rank in several calls (the case that once deadlocked on the H200), bf16
and fp8 wires; and the 1000-replay graph soak with the decode geometry (each replay checked against an eager call).
Run on the GPU machine (2 x H200)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m pytest -q -m gpu tests/test_gpu_decode.py
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

W = 2
CFG = dict(E=256, H=7168, Tmax=128, K=8)  # the decode profile of the benchmarks (EP2, DeepSeek-V3 layer)
SCRIPT = [[128, 0], [0, 128], [1, 0], [0, 0], [128, 128], [77, 3], [0, 1], [128, 0]]
GEOMETRY = "bt=1,dec=128"


def _world():
    if not torch.cuda.is_available() or torch.cuda.device_count() < W:
        pytest.skip(f"needs {W} GPUs")
    from tritonep.testing import run_gpu_world

    return run_gpu_world


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("wire,geometry", [("bf16", GEOMETRY), ("bf16", "bt=2,dec=64"), ("fp8", GEOMETRY)])
def test_decode_one_launch_equals_two_kernel_path(wire, geometry, graphs):
    from tritonep.testing.gpu_protocol import t_script_world

    run = _world()
    two = run(W, t_script_world, CFG, SCRIPT, graphs, "fs=0,fe=0", wire, timeout_s=600)
    one = run(W, t_script_world, CFG, SCRIPT, graphs, geometry, wire, timeout_s=600)
    for i, ts in enumerate(SCRIPT):
        for r in range(W):
            for k in ("x", "offs", "w", "eo", "y"):
                assert torch.equal(one[r][i][k], two[r][i][k]), (i, ts, r, k)


def test_decode_graph_soak_1000_replays():
    from tritonep.testing.gpu_decode import decode_soak_world

    res = _world()(W, decode_soak_world, GEOMETRY, 64, 512, 128, 8, 1000, timeout_s=1200)
    assert res == [(1000, []), (1000, [])], res
