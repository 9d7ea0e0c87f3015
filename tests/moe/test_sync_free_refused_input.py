"""``MoELayer(MoERecipe(sync_free=True))`` with an input one rank refuses on the host (more tokens than
``max_tokens_per_rank``; a wrong hidden size, refused before the dispatch; an expert id outside ``[-1, E)``, found
on the device), then steps with good inputs; both backends.

A sync-free dispatch reads nothing, so a rank whose own input is refused raises at once (its own error naming the
value) while its peers raise nothing in that step and go on to their combine: the refusing rank takes part in it as
refused (``EPBuffer.cancel_combine``, since ``EPBuffer.last_dispatch_read`` is False), so the peers' output is NaN
and every rank's next ``check()`` raises PeerInputError naming the refusing rank (the refusing rank too: its own
error was raised at the call). The next steps pair and equal the dense reference on every rank. An id outside
``[-1, E)`` is not seen on the host, so no rank raises in the step: every rank runs it as the refused call it is
(the empty layout: the output is zeros, docs/guarantees.md "Capacity") and every rank's ``check()`` raises (the
bad rank naming its value). Before, the refusing rank never took part in the combine: its peers waited
``timeout_s`` and the buffers ended timed out (triton), or the ranks' collectives no longer matched and gloo
aborted a rank (nccl).
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError, InputError, PeerInputError
from tritonep.testing import run_cpu_world

H, E, K, TM = 64, 4, 2, 8


def _geo():
    return tep.MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=TM)


def _inputs(rank, step, how):
    g = torch.Generator().manual_seed(10 * step + rank)
    T = TM + 1 if (step == 1 and rank == 1 and how == "cap") else 5
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    if step == 1 and rank == 1 and how == "shape":
        x = torch.randn(T, H + 8, generator=g).bfloat16()
    if step == 1 and rank == 1 and how == "id":
        idx[2, 1] = E + 3
    return x, idx, w


def _outcome(fn):
    try:
        y = fn()
        if y is None:
            return ("ok",)
        return ("y", "all NaN" if bool(torch.isnan(y).all()) else "finite" if bool(torch.isfinite(y).all()) else
                "some NaN", y.detach().clone())
    except PeerInputError as e:
        return ("PeerInputError", sorted(e.bad_ranks))
    except (InputError, CapacityError) as e:
        return (type(e).__name__, str(e)[:80])


def _world(group, backend, how):
    rank = dist.get_rank(group)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True), _geo(), group, seed=3, timeout_s=60, backend=backend)
    out = []
    for step in range(3):
        out.append(_outcome(lambda: layer(*_inputs(rank, step, how))))
        out.append(_outcome(layer.buffer.check))
    layer.close()
    return out


@pytest.mark.parametrize("backend,how", [("triton", "cap"), ("nccl", "cap"), ("triton", "shape"),
                                         ("nccl", "shape"), ("triton", "id"), ("nccl", "id")])
def test_sync_free_layer_refused_input_fails_on_every_rank_and_the_next_step_pairs(backend, how):
    from tritonep.reference import moe_dense_reference

    res = run_cpu_world(2, _world, backend, how, timeout_s=240)
    w1, w2 = tep.MoELayer.init_expert_weights(_geo(), seed=3)
    for r, out in enumerate(res):
        for step in (0, 2):  # before and after: every rank's output equals the dense reference
            y, chk = out[2 * step], out[2 * step + 1]
            assert y[:2] == ("y", "finite") and chk == ("ok",), (r, step, y[:2], chk)
            ref = moe_dense_reference(*_inputs(r, step, how), w1, w2)
            assert torch.allclose(y[2].float(), ref.float(), rtol=2 ** -5, atol=2 ** -5), (r, step)
        y, chk = out[2], out[3]
        if how == "id":  # found on the device: nobody raises in the step; the refused call's empty layout
            assert y[0] == "y" and bool((y[2] == 0).all()), (r, y[:2])
            assert chk == (("InputError", "topk_idx[2, 1] = 7 is outside [-1, num_experts=4)") if r == 1 else
                           ("PeerInputError", [1])), (r, chk)
        elif r == 1:  # the refusing rank: its own error at once, PeerInputError naming itself at check()
            assert y[0] == ("CapacityError" if how == "cap" else "InputError"), y
            assert chk == ("PeerInputError", [1]), chk
        else:  # its peer: a NaN output (never a finite wrong value), then the error at check()
            assert y[:2] == ("y", "all NaN"), y[:2]
            assert chk == ("PeerInputError", [1]), chk
