"""GPU check of a failed MoE layer backward on one rank (``pytest -m gpu``, the device machine): the CPU world's
cases (tests/moe/test_backward_failure.py) at ``gpu_world_size`` ranks (sharing one GPU when there is one; the nccl
backend needs one GPU per rank): the failing rank raises (sync-free: at its ``check()``), the peers' gradients are
NaN and their next read raises PeerInputError naming it, and the next step gives the bits of the step before.
"""

import pytest

from tests.moe import test_backward_failure as bf

pytestmark = pytest.mark.gpu


CASES = sorted({c[1:] for c in bf.CASES + bf.SLOW_CASES})  # (backend, how, read): the world size is the run's


@pytest.mark.parametrize("backend,how,read", CASES)
def test_gpu_failed_backward_takes_part_and_raises_on_every_rank(gpu_world, gpu_world_size, backend, how, read):
    if gpu_world_size < 2:
        pytest.skip("a failing peer needs a peer: gpu_world_size >= 2")

    def world(_W, fn, *args, timeout_s):
        return gpu_world(gpu_world_size, fn, *args, timeout_s=timeout_s, nccl=backend == "nccl")
    bf._run(gpu_world_size, backend, how, read, world=world)
