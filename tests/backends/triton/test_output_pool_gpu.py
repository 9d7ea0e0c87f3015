"""GPU checks of the output pool (:mod:`tritonep.runtime.pool`): sets per CUDA stream (a second stream gets its
own, a third allocates), never under graph capture (a captured call's outputs are the capture's, and eager calls
after a replay do not write them), the same results on every stream and under replay. World 1 and each
``--gpu-world-sizes`` (ranks share a GPU when there are fewer GPUs than ranks)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m pytest -q -m gpu tests/backends/triton/test_output_pool_gpu.py
"""

import pytest

from tritonep.bench.cases import experts_for

pytestmark = pytest.mark.gpu


def _check(gpu_world, W):
    from tests.support.gpu_pool import pool_streams_world

    res = gpu_world(W, pool_streams_world, experts_for(256, W), 7168, 128, 8, 128, timeout_s=600)
    for r, out in enumerate(res):
        store, rows, y = zip(*out["default"])
        assert out["default_pooled"] and not out["default_grew"], (r, out["default"])
        side, side_bytes = out["side"]
        third, third_bytes = out["third"]
        assert side != store[0], (r, "a second stream got the default stream's set")
        assert third_bytes == side_bytes, (r, "a third stream made a set", side_bytes, third_bytes)
        assert not out["graph_pooled"], (r, "a captured call took a pool set")
        assert out["graph_kept"], (r, "an eager call after the replay wrote the graph's output")
        assert out["graph_equal"] and out["eager_equal"], (r, out)


@pytest.mark.world1
def test_pool_streams_and_capture_world1(gpu_world):
    _check(gpu_world, 1)


def test_pool_streams_and_capture(gpu_world, gpu_world_size):
    _check(gpu_world, gpu_world_size)
