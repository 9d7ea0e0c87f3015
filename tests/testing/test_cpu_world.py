"""The CPU world (tritonep.testing.run_cpu_world): a rank that raises is named, a hung rank fails the world fast."""

import time

import pytest

from tritonep.errors import RankError
from tritonep.testing import WorldTimeout, run_cpu_world


def _raise_on_rank_1(group):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return 0


def _hang_on_rank_2(group):
    import torch.distributed as dist

    if dist.get_rank() == 2:
        time.sleep(600)
    return dist.get_rank()


def test_rank_exception_names_the_rank():
    t0 = time.time()
    with pytest.raises(RankError, match=r"rank 1 raised ValueError: boom on purpose"):
        run_cpu_world(3, _raise_on_rank_1, timeout_s=60)
    assert time.time() - t0 < 30


def test_hung_rank_fails_fast():
    t0 = time.time()
    with pytest.raises(WorldTimeout) as ei:
        run_cpu_world(3, _hang_on_rank_2, timeout_s=4)
    assert 2 in ei.value.ranks
    assert time.time() - t0 < 20
