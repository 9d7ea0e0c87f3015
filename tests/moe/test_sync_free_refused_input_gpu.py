"""GPU check of the sync-free MoE layer's refused input (``pytest -m gpu``, the device machine): the CPU world's
training loop (tests/moe/test_sync_free_refused_input.py) on the triton backend, two ranks sharing one GPU when
there is one (tests/conftest.py ``gpu_world``): no rank raises in the refused step, every output is NaN, every
rank's backward runs, every ``check()`` raises (the refusing rank its own error), and the steps around it equal
the dense reference.
"""

import pytest

from tests.moe import test_sync_free_refused_input as ri

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("how", ["cap", "shape", "id"])
def test_gpu_sync_free_layer_refused_input_runs_the_step_on_every_rank(gpu_world, how):
    ri.check_results(gpu_world(2, ri._world, "triton", how), how)
