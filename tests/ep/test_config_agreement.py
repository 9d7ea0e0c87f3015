"""A configuration refused on ONE rank is an error on EVERY rank, at once, with nothing allocated.

Before: the bad rank raised alone and its peers blocked in the constructor's collective until its process exited,
then failed with gloo's "connection closed". Now every check runs before the first collective and the verdicts
travel in it (:func:`tritonep.ep.config.agree`): the bad rank raises its own error naming its value, the others
:class:`tritonep.errors.PeerConfigError` naming the bad rank; differing configurations (max_tokens_per_rank on both
backends, num_sms, a combine kind from the environment) raise a ConfigError naming the field on every rank. The
worlds run with a short bound: a rank left waiting fails the test as a timeout.
"""

import os

import pytest
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import ConfigError, PeerConfigError, WireError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import check_calls, run_call


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


def _combine_env_world(group):
    rank = dist.get_rank(group)
    os.environ["TRITONEP_COMBINE"] = ["push", "pull"][rank]
    try:
        buf = tep.EPBuffer(group, 4, 64, 8, 2)
    except ConfigError:
        return "ConfigError"
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    out = run_call(buf, x, idx, w, out_buffer=False)
    buf.close()
    return (x, idx, w), out


def test_geometry_mismatch_across_ranks_is_refused_or_harmless():
    res = run_cpu_world(2, _combine_env_world, timeout_s=60)
    if res != ["ConfigError", "ConfigError"]:
        check_calls(dict(E=4), [[r[0]] for r in res], [[r[1]] for r in res])


def _num_sms_world(group):
    try:
        tep.EPBuffer(group, 4, 64, 8, 2, num_sms=1 + dist.get_rank(group)).close()
        return "no error"
    except ConfigError as e:
        return str(e)


def test_num_sms_mismatch_is_refused():
    for msg in run_cpu_world(2, _num_sms_world, timeout_s=60):
        assert "num_sms" in msg


def _mismatch_world(group, backend):
    try:
        tep.EPBuffer(group, 6, 64, 8 + dist.get_rank(group), 2, backend=backend)
        return "no error"
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_max_tokens_mismatch_raises_on_every_rank(backend):
    for msg in run_cpu_world(3, _mismatch_world, backend, timeout_s=60):
        assert "max_tokens_per_rank" in msg and "rank 0: 8" in msg and "rank 2: 10" in msg, msg


def _nccl_mode_world(group, how):
    mode = ["onehop", "gather"][dist.get_rank(group)]
    if how == "env":
        os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode
    try:
        tep.EPBuffer(group, 4, 64, 8, 2, backend="nccl", sync_free_mode=mode if how == "api" else None).close()
        return "no error"
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("how", ["env", "api"])
def test_nccl_sync_free_mode_mismatch_is_refused(how):
    """Ranks in different sync-free modes would run different collectives (one-hop: one all_to_all; gather: an
    all_gather then an all_to_all): the constructor refuses it on every rank, naming the field, whether the mode
    came from TRITONEP_NCCL_SYNC_FREE or from the ``sync_free_mode`` argument."""
    for msg in run_cpu_world(2, _nccl_mode_world, how, timeout_s=60):
        assert "sync_free_mode" in msg and "onehop" in msg and "gather" in msg, msg
