"""DeepEP's low-latency mode on the compat Buffer, checked against DeepEP's documented semantics in CPU worlds.

Per local expert, the received rows form a prefix ``[0, recv_count[e])`` of ``[L, W*M, H]``, ordered by (source rank,
source token) (DeepEP leaves the order inside a source's block open; tritonep's is deterministic); ``src_info``,
``layout_range`` and the cumulative stats as DeepEP defines them; fp8 rows carry the bits of
:func:`tritonep.wire.fp8.quantize_fp8_torch` (float, power-of-two and UE8M0-packed scales, column-major); the
combine is the weighted sum of the expert rows (one bf16 ulp: fp32 sums in another order), rows past the prefix
(NaN here) never read, through ``out=``, ``zero_copy`` and receive hooks, with two results alive. Token counts are
uneven (one rank has none) and ids hold -1 (with NaN weights, never read). W = 2 on both backends here; W = 3, 4, 8
on both backends in CI's slow step (the triton backend's kernels run in the interpreter: 6-30 s per world).
"""

import pytest

from tests.compat.ll_checks import ll_case
from tritonep.testing import run_cpu_world

SLOW = pytest.mark.slow
CASES = [pytest.param(2, "triton"), pytest.param(2, "nccl"), pytest.param(4, "nccl", marks=SLOW),
         pytest.param(3, "nccl", marks=SLOW), pytest.param(3, "triton", marks=SLOW), pytest.param(4, "triton", marks=SLOW),
         pytest.param(8, "triton", marks=SLOW), pytest.param(8, "nccl", marks=SLOW)]


@pytest.mark.parametrize("world,backend", CASES)
def test_low_latency_mode_matches_deepep_semantics(world, backend):
    assert run_cpu_world(world, ll_case, backend, world, timeout_s=600) == [5] * world
