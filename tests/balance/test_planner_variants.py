"""The planner compiles one variant for token counts T of one launch geometry: ``num_routes = T*K`` is a runtime
argument Triton does not specialise (``do_not_specialize``), so a layer whose T changes per step does not recompile
``plan_kernel`` for T*K = 1, a multiple of 16 and the rest (Triton's cache key, :mod:`tests.support.variant_keys`,
of the real launches; a record per distinct key)."""

import tempfile

import pytest

from tritonep.balance import plan

from tests.balance.planner_cases import check_remap, make_topk
from tests.support.variant_keys import key_text, read_keys, record_keys_to


@pytest.mark.parametrize("mode", ["reference", "minimal"])
def test_token_counts_of_one_geometry_share_one_variant(mode):
    W, E, K = 2, 8, 2
    with tempfile.NamedTemporaryFile() as f:
        with record_keys_to(f.name):
            for T in (101, 104, 107):  # T*K = 202, 208 (a multiple of 16), 214: one geometry (one chunk of 256)
                topks, counts = make_topk(W, E, K, [T, T], seed=T)
                plans = [plan(counts, topks[r], r, validate=True, mode=mode) for r in range(W)]
                check_remap(topks, counts, plans[0][0], [rid for _, rid in plans])  # still right
        recs = read_keys(f.name)
    keys = {key_text(r["key"]) for r in recs if r["key"]["name"] == "plan_kernel"}
    assert len(keys) == 1, f"{len(keys)} plan_kernel variants for T*K = 202, 208, 214"
