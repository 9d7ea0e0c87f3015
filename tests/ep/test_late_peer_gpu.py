"""GPU check of a rank that reaches a call after its peers gave up waiting for it (``pytest -m gpu``, the device
machine): the CPU world's rank body (tests/ep/test_late_peer.py) on real GPUs, ranks sharing one GPU when there are
fewer GPUs than ranks (tests/conftest.py ``gpu_world``), every triton path forced by its GPU geometry. The timed-out
rank's marks (``flags[FLAG_DEAD]``, plain stores ordered by its signals' release) must reach the late rank before
it uses the skipped rows: NaN output, PeerTimeoutError naming the peer that gave up at ``check()``, rebuilt buffers
exact.
"""

import pytest

from tests.ep import test_late_peer as lp

pytestmark = pytest.mark.gpu

GPU_PATHS = {"two_kernel": "dec=0,fs=0,fe=0,fc=0", "fused": "fs=8,fe=8,fc=1", "decode": "bt=2,dec=2"}


def _late_world(group, geometry, sync_free):
    lp.GEOMETRIES[geometry] = GPU_PATHS[geometry]  # the GPU grids (this rank process's own copy of the table)
    return lp._late_world(group, geometry, sync_free)


@pytest.mark.parametrize("geometry,sync_free", [("two_kernel", True), ("fused", True), ("decode", True),
                                                ("decode", False)])
def test_gpu_late_rank_never_takes_what_its_timed_out_peers_skipped(gpu_world, gpu_world_size, geometry, sync_free):
    res = gpu_world(gpu_world_size, _late_world, geometry, sync_free)
    late, early = res[-1], res[:-1]
    W = len(res)
    for out in early:
        assert out["late"] == (("ok", "all NaN") if sync_free else ("PeerTimeoutError", "dispatch.counts", W - 1))
        assert out["check"] == ("PeerTimeoutError", "dispatch.counts", W - 1, True), out["check"]
    assert late["late"] == (("ok", "all NaN") if sync_free else ("PeerTimeoutError", "peer.gave_up", 0))
    assert late["check"] == ("PeerTimeoutError", "peer.gave_up", 0, True), late["check"]
    lp.check_grads(2 * W, [out["good"] for out in res], where="rebuilt buffer")
