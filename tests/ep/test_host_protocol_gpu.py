"""GPU checks of the host protocol rule (docs/protocols.md, "Host protocol rule"): uneven per-rank token
scripts (0 included, changing every call) eagerly and in CUDA graphs at several geometries; a bad input on one rank.
At each ``--gpu-world-sizes`` (the 2-rank scripts widened by :func:`tritonep.bench.cases.script_for`); ranks share a
GPU when there are fewer GPUs than ranks."""

import pytest

from tritonep.bench.cases import experts_for, make_rank_inputs, script_for
from tests.support.harness import check_calls

pytestmark = pytest.mark.gpu

# first the case that once made one rank compile (and barrier) alone: rank 1 always empty, rank 0 at 1 then 2
# tokens; then every mix, 0 and Tmax included
SCRIPT_8 = [[1, 0], [2, 0], [0, 0], [8, 0], [0, 8], [3, 5], [8, 8], [0, 1], [7, 2], [1, 1], [2, 0], [0, 3]]
SCRIPT_256 = [[1, 0], [2, 0], [0, 256], [256, 1], [200, 0], [0, 0], [17, 255], [256, 256]]
CFGS = {
    "decode-default": (dict(E=64, H=2048, Tmax=8, K=8), SCRIPT_8, ""),
    "decode-fused": (dict(E=64, H=2048, Tmax=8, K=8), SCRIPT_8, "fs=8,fe=8,fc=1"),
    "decode-1launch": (dict(E=64, H=2048, Tmax=8, K=8), SCRIPT_8, "bt=1,dec=8"),
    "bt4-default": (dict(E=256, H=7168, Tmax=256, K=8), SCRIPT_256, ""),
    "bt4-fused": (dict(E=256, H=7168, Tmax=256, K=8), SCRIPT_256, "fs=40,fe=88"),
    "bt4-1launch": (dict(E=256, H=7168, Tmax=256, K=8), SCRIPT_256, "dec=64"),
    # >= 1024 tokens: the table's default is the fused one-launch dispatch
    "big-default": (dict(E=256, H=7168, Tmax=1024, K=8), [[1, 0], [1024, 0], [0, 1024], [500, 700], [0, 0]], ""),
}


def _check(cfg, script, res):
    W = len(script[0])
    calls = [[make_rank_inputs(r, ts[r], cfg["H"], cfg["E"], cfg["K"], seed=1000 + i) for i, ts in enumerate(script)]
             for r in range(W)]
    check_calls(cfg, calls, res)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", list(CFGS))
def test_per_rank_token_script(gpu_world, gpu_world_size, name, graphs):
    from tests.support.gpu_protocol import t_script_world

    W = gpu_world_size
    cfg, script, geometry = CFGS[name]
    cfg, script = dict(cfg, E=experts_for(cfg["E"], W)), script_for(script, W)
    res = gpu_world(W, t_script_world, cfg, script, graphs, geometry, timeout_s=300)
    _check(cfg, script, res)


def test_bad_input_on_one_rank_gpu(gpu_world, gpu_world_size):
    from tests.support.gpu_protocol import bad_input_world

    W = gpu_world_size
    E = experts_for(64, W)
    res = gpu_world(W, bad_input_world, E, timeout_s=300)
    assert res[1][1][0] == "InputError" and str(E + 35) in res[1][1][1], res[1][1]
    for r in range(W):
        if r != 1:
            assert res[r][1][0] == "PeerInputError" and "[1]" in res[r][1][1], (r, res[r][1])
    for step in (0, 2):
        assert all(res[r][step][0] == "ok" for r in range(W)), step
        check_calls(dict(E=E), [[make_rank_inputs(r, 1 + step, 2048, E, 8, seed=50 + step)] for r in range(W)],
                    [[res[r][step][1]] for r in range(W)])
