"""DeepEP's normal mode on the compat Buffer, checked against DeepEP's documented semantics in CPU worlds.

Every rank's inputs are gathered and the expected receive is computed by plain loops
(:mod:`tests.compat.deepep_reference`): rows bit for bit in (source rank, source token) order, local ids and weights,
per-expert counts (aligned), the rank prefix matrix, the combine's unweighted sum over ranks (fp32, ranks ascending,
one bf16 rounding) and its reduced weights, biases, cached dispatch, caller-quantized rows (float and int32 scales,
column-major scales) handed on bit for bit, dispatch without top-k, and ``num_worst_tokens`` (received rows first, ids
-1 and weight 0 after, rows past the received ones never read by the combine). Token counts are uneven and one rank
has none. W = 2 on both backends, 3 and 4 on the nccl backend here; the triton backend at W = 3, 4, 8 and the nccl
backend at W = 8 in CI's slow step. The top-k travels as meta rows of the rows lane at these sizes (the Buffer's
default); the meta lane's way (``meta_rows_max_tokens=0``) at W = 2 on both backends (W = 3 in the slow step).
"""

import pytest

from tests.compat.normal_checks import normal_case
from tritonep.testing import run_cpu_world

SLOW = pytest.mark.slow  # the triton backend's kernels run in the interpreter: 8-50 s per world of 3-8 ranks
CASES = [pytest.param(2, "triton"), pytest.param(2, "nccl"), pytest.param(3, "nccl"), pytest.param(4, "nccl"),
         pytest.param(3, "triton", marks=SLOW), pytest.param(4, "triton", marks=SLOW),
         pytest.param(8, "triton", marks=SLOW), pytest.param(8, "nccl", marks=SLOW)]


@pytest.mark.parametrize("world,backend", CASES)
def test_normal_mode_matches_deepep_semantics(world, backend):
    # these token counts make the top-k travel as meta rows of the rows lane (one exchange per dispatch); the
    # combine of topk_weights dispatches a meta lane routed like it ("meta2"); no top-k: a plain rows lane ("x")
    kinds = ["meta2", "x", "xm"]
    assert run_cpu_world(world, normal_case, backend, world, None, kinds, timeout_s=600) == [2] * world


@pytest.mark.parametrize("world,backend", [pytest.param(2, "triton"), pytest.param(2, "nccl"),
                                           pytest.param(3, "triton", marks=SLOW), pytest.param(3, "nccl", marks=SLOW)])
def test_normal_mode_with_the_meta_lane(world, backend):
    """``meta_rows_max_tokens=0``: the top-k travels in the meta lane (a second exchange), the same semantics."""
    assert run_cpu_world(world, normal_case, backend, world, 0, ["meta", "x"], timeout_s=600) == [2] * world
