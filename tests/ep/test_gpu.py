"""GPU suite (device machine, ``pytest -m gpu``): the CPU-world checks again on real GPUs, plus CUDA graphs.

Every test runs at each ``--gpu-world-sizes`` (default 2), with ranks sharing a GPU when there are fewer GPUs than
ranks (tests/conftest.py, ``gpu_world``). Shapes follow the world size: per-rank token counts cycle over the ranks and
the expert count is rounded up to a multiple of it.
"""

import pytest
import torch

from tritonep.bench.cases import experts_for, make_rank_inputs, tokens_for
from tests.support.harness import check_calls, check_grads

pytestmark = pytest.mark.gpu


def test_cuda_heap_peer_write(gpu_world, gpu_world_size):
    from tests.support.gpu_checks import heap_peer_write_world

    W = gpu_world_size
    res = gpu_world(W, heap_peer_write_world, 3)
    for outs, st in res:
        assert int(st[0]) == 0
        for e, data in enumerate(outs):
            want = torch.tensor([[(e + 1) * 1000 + s * 100 + i for i in range(8)] for s in range(W)])
            assert torch.equal(data, want)


CASES = [
    dict(E=8, H=96, Tmax=16, K=3, T=[13, 0], seeds=[1, 2, 3, 4, 5]),
    dict(E=16, H=2880, Tmax=64, K=4, A=128, T=[64, 37], seeds=[6], kind="pull"),
    dict(E=256, H=7168, Tmax=512, K=8, T=[512, 300], seeds=[7, 8]),
    dict(E=64, H=2048, Tmax=128, K=6, T=[128, 128], seeds=[9], mask=0.3, kind="pull"),
]


def test_ep_cases_match_reference(gpu_world, gpu_world_size):
    from tests.support.gpu_checks import ep_cases_world

    W = gpu_world_size
    cases = [dict(c, E=experts_for(c["E"], W), T=tokens_for(c["T"], W)) for c in CASES]
    res = gpu_world(W, ep_cases_world, cases)
    for ci, c in enumerate(cases):
        calls = [[make_rank_inputs(r, c["T"][r], c["H"], c["E"], c["K"], seed=s, mask_frac=c.get("mask", 0.1))
                  for s in c["seeds"]] for r in range(W)]
        check_calls(c, calls, [res[r][ci] for r in range(W)])


def test_cuda_graph_100_replays(gpu_world, gpu_world_size):
    from tests.support.gpu_checks import ep_graph_world

    W = gpu_world_size
    res = gpu_world(W, ep_graph_world, experts_for(64, W), 512, 128, 8, 100)
    assert res == [[]] * W, res


def test_gradients_match_reference(gpu_world, gpu_world_size):
    from tests.support.gpu_checks import ep_grad_world

    W = gpu_world_size
    E = experts_for(16, W)
    res = gpu_world(W, ep_grad_world, E, 256, 64, 4, tokens_for([64, 17], W))
    check_grads(E, res)
