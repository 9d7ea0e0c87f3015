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


def _on_decode_tiles(group, *args):
    """:func:`normal_case` on the one-launch decode tiles (what a GPU takes up to 256 tokens): DeepEP's per-expert
    counts come with the rows lane's status (its count routing) instead of the unpacking's read, and on the rows lane
    of the meta-rows way the ids and weights ride with the rows (no meta row travels)."""
    import os

    os.environ["TRITONEP_GEOMETRY"] = "bt=2,dec=3"
    return normal_case(group, *args)


@pytest.mark.parametrize("world,meta_rows_max_tokens,kinds,carried", [
    (2, None, ["meta2", "x", "xm"], True), (2, 0, ["meta", "x"], False),
    pytest.param(3, None, ["meta2", "x", "xm"], True, marks=SLOW)])
def test_normal_mode_on_the_decode_tiles(world, meta_rows_max_tokens, kinds, carried):
    """The top-k carried with the rows (the default at these sizes) and the meta lane (``meta_rows_max_tokens=0``)."""
    assert run_cpu_world(world, _on_decode_tiles, "triton", world, meta_rows_max_tokens, kinds, carried,
                         timeout_s=600) == [2] * world
