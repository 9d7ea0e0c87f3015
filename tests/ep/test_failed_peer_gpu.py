"""GPU checks of the overflow, failed-peer and in-place cases (``pytest -m gpu``, the device machine).

The CPU worlds' rank bodies again on real GPUs (ranks sharing one GPU when there are fewer GPUs than ranks, time-
sliced or under MPS: tests/conftest.py ``gpu_world``), with every triton path forced by its geometry:

* an overflowing sync-free dispatch, its combine and both backward passes: empty layout, zeros, CapacityError at
  ``check()`` on every rank, exact calls afterwards (tests/ep/test_overflow_backward.py); under
  ``compute-sanitizer --tool memcheck`` the same step runs from benchmarks/probes/overflow_memcheck.py;
* a refused or cancelled combine: PeerInputError on every peer (eager) or NaN and ``check()`` (sync-free), the buffer
  usable afterwards (tests/ep/test_failed_peer.py);
* an in-place edit of the dispatched weights inside a CUDA-graph capture, refused at the backward
  (tests/ep/test_inplace_saved.py).

The nccl backend's versions need one GPU per rank (NCCL refuses two ranks on one GPU): they run where there are.
"""

import pytest
import torch

from tests.ep import test_failed_peer as fp
from tests.ep import test_overflow_backward as ob

pytestmark = pytest.mark.gpu

GPU_PATHS = {"two_kernel": "dec=0,fs=0,fe=0,fc=0", "fused": "dec=0,fs=8,fe=8,fc=1", "decode": "bt=2,dec=2"}


def _overflow_world(group, path, A, sync_free, geometry):
    ob.PATHS[path] = ("triton", geometry, None)  # the GPU grids (this rank process's own copy of the table)
    return ob._world(group, path, A, sync_free, 1)


@pytest.mark.parametrize("path", ["two_kernel", "fused", "decode"])
def test_gpu_sync_free_overflow_then_backward(gpu_world, gpu_world_size, path):
    res = gpu_world(gpu_world_size, _overflow_world, path, 1, True, GPU_PATHS[path])
    ob.PATHS[path] = ("triton", GPU_PATHS[path], None)
    ob._assert_world(res, path)


@pytest.mark.world1
def test_gpu_world1_overflow_with_aligned_segments(gpu_world):
    """One rank (its own experts only), expert_alignment 4, sync checks off: the memcheck probe's world-1 case."""
    res = gpu_world(1, _overflow_world, "two_kernel", 4, False, GPU_PATHS["two_kernel"])
    ob.PATHS["two_kernel"] = ("triton", GPU_PATHS["two_kernel"], None)
    ob._assert_world(res, "two_kernel", A=4)


def _refusal_world(group, geometry, sync_free, how, bad):
    fp.GEOMETRIES[geometry] = GPU_PATHS[geometry]
    return fp._refusal_world(group, "triton", geometry, sync_free, how, bad)


@pytest.mark.parametrize("geometry,sync_free,how", [("two_kernel", False, "dtype"), ("fused", True, "cancel"),
                                                    ("decode", False, "rows"), ("decode", True, "handle")])
def test_gpu_refused_or_cancelled_combine(gpu_world, gpu_world_size, geometry, sync_free, how):
    bad = [gpu_world_size - 1]
    res = gpu_world(gpu_world_size, _refusal_world, geometry, sync_free, how, bad)
    fp._assert_refused(res, geometry, sync_free, how, bad)


def _captured_inplace_world(group):
    """A sync-free dispatch -> combine captured in a CUDA graph with the dispatched weights edited in place inside
    the capture: the backward (eager, after the capture) refuses, by the weights' version counter."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs

    from tests.support.harness import set_env

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    set_env(TRITONEP_GEOMETRY=GPU_PATHS["two_kernel"])  # the row weights a fresh tensor (no pooled view)
    buf = tep.EPBuffer(group, 2 * W, 64, 8, 2)
    set_env(TRITONEP_GEOMETRY=None)
    dev = buf.device
    x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, 5, 64, 2 * W, 2, seed=1))
    x.requires_grad_(True)
    w.requires_grad_(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d = buf.dispatch(x, idx, w, sync_free=True)
        d.weights.mul_(2)
        y = buf.combine(d.x.clone(), d.handle)
    graph.replay()
    torch.cuda.synchronize()
    try:
        y.float().sum().backward()
        out = "accepted"
    except RuntimeError as e:
        out = "refused" if "modified by an inplace operation" in str(e) or "modified inplace" in str(e) else str(e)
    buf.check()
    buf.close()
    return out


def test_gpu_captured_inplace_edit_is_refused(gpu_world, gpu_world_size):
    assert gpu_world(gpu_world_size, _captured_inplace_world) == ["refused"] * gpu_world_size
