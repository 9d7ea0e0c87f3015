"""Virtual experts on degenerate loads against the dense single-process reference: every route on one expert, every
route masked (-1) on every rank (no route at all: capacity 0), no token on any rank, every token on one rank and its
routes on another rank's experts, every token listing one expert twice; then (slow) the nccl backend, the pull
combine, alignments 4 and 8, and a world of 3. Output and every gradient (x, topk_weights, native w1 / w2, replicas' gradients
pulled back) as tests/moe/test_virtual.py checks them."""

import pytest
import torch

import tests.moe.test_virtual as tv
from tritonep.testing import run_cpu_world

_plain = tv._step_routing


def _routing(case, step, W):
    st = case["steps"][step]
    if "parts" not in st:
        return _plain(case, step, W)
    g = torch.Generator().manual_seed(st["seed"])
    out = []
    for r in range(W):
        idx = st["parts"](r)
        out.append((idx, torch.rand(idx.shape, generator=g) + 0.1))
    return out


def _dense_reference(case, res, W):
    """tests/moe/test_virtual.py's reference, with a zero gradient where no route reads a tensor (all masked)."""
    from tritonep.reference import moe_dense_reference

    w1 = torch.cat([r["w1"] for r in res]).float()
    w2 = torch.cat([r["w2"] for r in res]).float()
    refs = []
    for step in range(len(case["steps"])):
        ins = tv._step_inputs(case, step, W)
        sizes = [a[0].shape[0] for a in ins]
        x = torch.cat([a[0] for a in ins]).float().requires_grad_(True)
        tw = torch.cat([a[2] for a in ins]).float().requires_grad_(True)
        a1, a2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        ids = torch.cat([a[1] for a in ins])
        y = moe_dense_reference(x, ids, tw, a1, a2) + 0 * (x.sum() + tw.sum() + a1.sum() + a2.sum())
        (y * torch.cat([a[3] for a in ins])).sum().backward()
        refs.append(dict(y=y.detach().split(sizes), gx=x.grad.split(sizes), gtw=tw.grad.split(sizes), gw1=a1.grad,
                         gw2=a2.grad, routes=int((ids >= 0).sum())))
    return refs


tv._step_routing = _routing  # the forked ranks and the parent's reference read routing through it
tv._dense_reference = _dense_reference

E, K = 8, 2


def _one_expert(r):  # every token of every rank: expert 5 and nothing else
    return torch.tensor([[5, -1]] * (3 + 2 * r))


def _masked(r):
    return torch.full((2 + r, K), -1)


def _empty(r):
    return torch.empty(0, K, dtype=torch.int64)


def _one_rank(r):  # rank 0 has every token, all on rank 1's experts 4 and 5 (and 6 on the last)
    return torch.tensor([[4, 5]] * 6 + [[6, 4]]) if r == 0 else torch.empty(0, K, dtype=torch.int64)


def _dup(r):  # every token lists one expert twice: two routes of it
    return torch.tensor([[1, 1], [6, 6], [1, 6]] * (2 + r))


STEPS = {"dup": _dup, "one_expert": _one_expert, "masked": _masked, "empty": _empty, "one_rank": _one_rank}


@pytest.mark.parametrize("name", [n if n in ("masked", "one_rank") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in STEPS])
def test_virtual_degenerate_load_matches_dense_reference(name):
    steps = [dict(parts=STEPS[name], seed=1), dict(parts=_one_expert, seed=2)]  # then a step that moves routes
    case = dict(E=E, K=K, seed=9, steps=steps)
    res = run_cpu_world(2, tv._virtual_world, case, timeout_s=300)
    tv._check_dense(case, res)


@pytest.mark.slow
@pytest.mark.parametrize("opts", [dict(backend="nccl", A=4), dict(combine="pull", A=4), dict(A=8)])
def test_virtual_degenerate_loads_other_paths(opts):
    steps = [dict(parts=_masked, seed=1), dict(parts=_one_expert, seed=2), dict(parts=_one_rank, seed=3),
             dict(parts=_dup, seed=4)]
    case = dict(E=E, K=K, seed=9, steps=steps, **opts)
    res = run_cpu_world(2, tv._virtual_world, case, timeout_s=300)
    tv._check_dense(case, res)


@pytest.mark.slow
def test_virtual_degenerate_loads_world3():
    steps = [dict(parts=_one_expert, seed=2), dict(parts=_masked, seed=1), dict(parts=_one_rank, seed=3),
             dict(parts=_dup, seed=4), dict(parts=_empty, seed=5)]
    case = dict(E=12, K=K, seed=9, steps=steps, A=2)
    res = run_cpu_world(3, tv._virtual_world, case, timeout_s=600)
    tv._check_dense(case, res)
