"""Issue 25 class 3: a configuration refused on ONE rank is an error on EVERY rank, at once, with nothing allocated.

Before: the bad rank raised alone and its peers blocked in the constructor's collective until its process exited,
then failed with gloo's "connection closed". Now every check runs before the first collective and the verdicts
travel in it (:func:`tritonep.ep.config.agree`): the bad rank raises its own error naming its value, the others
:class:`tritonep.errors.PeerConfigError` naming the bad rank; differing configurations raise a ConfigError naming the
field on every rank. The worlds run with a short bound: a rank left waiting fails the test as a timeout.
"""

import pytest
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import ConfigError, PeerConfigError, WireError
from tritonep.testing import run_cpu_world


def _build(group, per_rank: dict, what: str):
    rank = dist.get_rank(group)
    kw = dict(num_experts=12, hidden=128, max_tokens_per_rank=8, topk=2)
    kw.update(per_rank.get(rank, {}))
    try:
        if what == "buffer":
            tep.EPBuffer(group, **kw).close()
        else:
            geo = tep.MoEGeometry(hidden=kw["hidden"], intermediate=32, num_experts=kw["num_experts"], topk=2,
                                  max_tokens_per_rank=8)
            recipe = tep.MoERecipe(**kw.get("recipe", {}))
            tep.MoELayer(recipe, geo, group).close()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message of every rank's error
        return type(e).__name__, str(e), getattr(e, "bad_ranks", None)
    return None


@pytest.mark.parametrize("W,bad,own", [
    (2, {0: dict(hidden=100, dispatch_wire="fp8")}, WireError),      # fp8 needs a multiple of 128
    (3, {2: dict(num_experts=7)}, ConfigError),                       # not divisible by the world size
    (3, {1: dict(topk=0)}, ConfigError),
])
def test_one_bad_rank_raises_everywhere(W, bad, own):
    res = run_cpu_world(W, _build, bad, "buffer", timeout_s=60)
    (bad_rank,) = bad
    for r, out in enumerate(res):
        assert out is not None, f"rank {r} built a buffer"
        name, msg, ranks = out
        if r == bad_rank:
            assert name == own.__name__, out
        else:
            assert name == "PeerConfigError" and ranks == [bad_rank], out
            assert f"rank {bad_rank}" in msg


def test_two_bad_ranks_are_both_named():
    res = run_cpu_world(3, _build, {0: dict(expert_alignment=0), 2: dict(combine_wire="int3")}, "buffer",
                        timeout_s=60)
    assert res[0][0] == "ConfigError" and res[2][0] == "WireError"
    assert res[1][0] == "PeerConfigError" and res[1][2] == [0, 2]


def test_differing_configs_name_the_field_on_every_rank():
    res = run_cpu_world(2, _build, {1: dict(max_tokens_per_rank=9)}, "buffer", timeout_s=60)
    for out in res:
        assert out[0] == "ConfigError" and "max_tokens_per_rank" in out[1] and "rank 1: 9" in out[1]


def test_moe_layer_refused_on_one_rank_raises_everywhere():
    res = run_cpu_world(2, _build, {1: dict(recipe=dict(combine="push", combine_wire="fp8"), hidden=64)}, "layer",
                        timeout_s=60)
    assert res[1] is not None and res[1][0] == "ConfigError"
    assert res[0] is not None and res[0][0] == "PeerConfigError" and res[0][2] == [1]


def test_peer_config_error_is_a_config_error():
    assert issubclass(PeerConfigError, ConfigError) and tep.PeerConfigError is PeerConfigError
