"""The compat Buffer's semantic checks on GPUs: a world of one rank and the multi-rank world (``gpu_world``; ranks
share a GPU when there are fewer GPUs than ranks). The same rank functions as the CPU worlds
(:mod:`tests.compat.normal_checks`, :mod:`tests.compat.ll_checks`, :func:`tests.compat.test_packing.all_patterns`),
on the device: rows and ids bit for bit against DeepEP's semantics, the combines, fp8 bits, and every 16-bit pattern
through the compiled kernels (the premise of carrying quantized rows and metadata in bf16 rows); and the refusals
(:mod:`tests.compat.test_worst_overflow`: a ``num_worst_tokens`` call over capacity, NaN outputs by the compiled
poison kernel and CapacityError at the next synced dispatch / ``check()``; :mod:`tests.compat.test_combine_refused`:
one rank refusing a call, every rank raising). The nccl backend needs an NCCL group: one GPU per rank (it skips,
saying so, on shared GPUs)."""

import pytest

from tests.compat import test_combine_refused as refused
from tests.compat import test_worst_overflow as worst
from tests.compat.ll_checks import ll_case
from tests.compat.normal_checks import normal_case
from tests.compat.test_packing import all_patterns

pytestmark = pytest.mark.gpu


@pytest.mark.world1
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_compat_world1(gpu_world, backend):
    assert gpu_world(1, normal_case, backend, 1) == [2]
    assert gpu_world(1, ll_case, backend, 1) == [5]
    assert gpu_world(1, all_patterns, backend) == [True]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_compat_world(gpu_world, gpu_world_size, backend):
    W = gpu_world_size
    nccl = backend == "nccl"
    assert gpu_world(W, normal_case, backend, W, nccl=nccl) == [2] * W
    assert gpu_world(W, ll_case, backend, W, nccl=nccl) == [5] * W
    assert gpu_world(W, all_patterns, backend, nccl=nccl) == [True] * W


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_compat_refusals_world(gpu_world, gpu_world_size, backend):
    W = gpu_world_size
    if W < 2:
        pytest.skip("a refusal needs a peer: gpu_world_size >= 2")
    nccl = backend == "nccl"
    assert gpu_world(W, worst._world, backend, nccl=nccl) == [worst.EXPECT] * W
    for how in ("dtype", "worst", "worst_handle", "cached", "worst_dispatch"):
        refused.assert_normal(gpu_world(W, refused._normal_world, backend, how, nccl=nccl), how)
    for how in ("combine", "dispatch"):
        refused.assert_ll(gpu_world(W, refused._ll_world, backend, how, nccl=nccl), backend, how)
