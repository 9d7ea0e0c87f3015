"""Soaks: many dispatch + combine calls with fresh random routing on one buffer, each checked against the
reference (30 calls in the default run; 500 calls and the 1000-replay CUDA-graph soak carry the ``soak`` marker:
CI runs the 500 in its second step, the GPU soak runs on the device machine)."""

import pytest

from tritonep.bench.soak import soak_world
from tritonep.testing import run_cpu_world

SOAK = dict(E=12, H=96, Tmax=12, K=3, A=2)


def test_soak_30_calls():
    res = run_cpu_world(3, soak_world, 30, SOAK, 1, timeout_s=300)
    assert res == [(30, [])] * 3, res


@pytest.mark.soak
def test_soak_500_calls():
    res = run_cpu_world(3, soak_world, 500, SOAK, 2, timeout_s=3600)
    assert res == [(500, [])] * 3, res


@pytest.mark.gpu
@pytest.mark.soak
def test_gpu_graph_soak_1000_replays(gpu_world):
    from tests.support.gpu_checks import graph_soak_world

    res = gpu_world(2, graph_soak_world, 64, 512, 128, 8, 1000, timeout_s=1200)
    assert res == [(1000, []), (1000, [])], res
