"""``torch.library.opcheck`` on the four ops of :mod:`tritonep.ep.ops` (dispatch, combine and their backwards).

Every default sub-check (schema, autograd registration, fake tensor, AOT dispatch with dynamic shapes) on every op,
in CPU worlds of 1 and 2 ranks, on the triton backend's two-kernel, one-launch decode (``TRITONEP_GEOMETRY=dec=2``)
and fused (``fs=1,fe=1``: the GPU table's dispatch at >= 1024 tokens per rank, EP >= 2) paths, with and without
``sync_free``, and on the nccl backend. The fake-tensor check
compares every real output's sizes, strides and storage offset with its fake's: the row weights are a view of the
triton handle's storage (its field ``rw`` comes first in :class:`tritonep.backends.triton.outputs.HandleLayout`, so that
view starts at offset 0 as the fake's fresh tensor does) and the ``[2L]`` ``num_tokens_per_expert |
expert_offsets`` pair is a tensor of its own.

One sub-check cannot apply as it stands to ``tritonep::dispatch``: ``test_aot_dispatch_dynamic`` compares the eager
and the compiled outputs, and the ticket is a new id per call by design (and a sync-free call's rows past
``expert_offsets[-1]`` are unspecified). That op runs the same check (``aot_autograd_check``, what opcheck calls)
on the op minus its ticket, with those rows zeroed. The backward ops get no input that requires grad (they have no
autograd formula: no double backward), so opcheck's autograd-registration check has nothing to check there. Every
rank runs the same ops in the same order (the checks are collectives; the recorder checks the launch sequence).
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.optests.aot_autograd import aot_autograd_check
from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS

import tritonep as tep
from tritonep.ep import ops
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

E, H, TM, K = 8, 64, 8, 2
TOKENS = (6, 3)  # per rank
# (backend, TRITONEP_GEOMETRY, sync_free)
CASES = (("triton", "", False), ("triton", "", True), ("triton", "dec=2", False), ("triton", "dec=2", True),
         ("triton", "fs=1,fe=1", False), ("triton", "fs=1,fe=1", True), ("nccl", "", False), ("nccl", "", True))
_AOT = "test_aot_dispatch_dynamic"
_OPS = torch.ops.tritonep


def _failures(results: dict) -> dict:
    return {k: f"{type(v).__name__}: {v} <- {v.__cause__!r}" for k, v in results.items() if v != "SUCCESS"}


def _opcheck(op, args, utils=tuple(DEFAULT_TEST_UTILS)) -> dict:
    """opcheck's failures, ``{sub-check: message}`` (no raise: every rank must run every check, they pair)."""
    return _failures(torch.library.opcheck(op, args, test_utils=utils, raise_exception=False))


def _aot_dispatch(bid, sync_free, x, idx, w) -> dict:
    """``test_aot_dispatch_dynamic`` for ``tritonep::dispatch`` minus the ticket (module docstring)."""

    def dispatch_no_ticket(x, idx, w):
        rows, rw, pair, _ticket = _OPS.dispatch(x, idx, w, bid, sync_free)  # autograd keeps the ticket
        live = torch.arange(rows.shape[0], device=rows.device) < pair[-1]
        return torch.where(live[:, None], rows, 0), rw, pair

    exact = functools.partial(torch.testing.assert_close, rtol=0, atol=0)
    try:
        aot_autograd_check(dispatch_no_ticket, (x, idx, w), {}, dynamic=True, check_gradients="auto",
                           assert_equals_fn=exact)
    except Exception as e:  # noqa: BLE001 (reported like opcheck's failures)
        return _failures({_AOT: e})
    return {}


def _world(group, ntokens, cases):
    """Per case, every op's failures (``{(case, op): {sub-check: message}}``, empty when all pass)."""
    rank = dist.get_rank(group)
    T = ntokens[rank]
    out = {}
    for backend, geometry, sync_free in cases:
        os.environ["TRITONEP_GEOMETRY"] = geometry
        buf = tep.EPBuffer(group, E, H, TM, K, backend=backend)
        os.environ.pop("TRITONEP_GEOMETRY")
        g = buf.tiles
        assert buf.backend == backend and ((g.decode if g else 0) > 0) == geometry.startswith("dec")
        assert ((g.fused_send if g else 0) > 0) == geometry.startswith("fs")
        bid = ops.buffer_id(buf)
        case = f"{backend} {geometry or 'two-kernel' if backend == 'triton' else ''} sync_free={sync_free}"
        x, idx, w = make_rank_inputs(rank, T, H, E, K, seed=3, mask_frac=0.2)
        x, w = x.requires_grad_(), w.requires_grad_()
        fails = _opcheck(_OPS.dispatch.default, (x, idx, w, bid, sync_free), [u for u in DEFAULT_TEST_UTILS
                                                                               if u != _AOT])
        out[case, "dispatch"] = dict(fails, **_aot_dispatch(bid, sync_free, x, idx, w))
        rows, rw, pair, ticket = _OPS.dispatch(x.detach(), idx, w.detach(), bid, sync_free)
        live = (torch.arange(rows.shape[0]) < pair[-1])[:, None]  # (a sync-free call's tail is unspecified)
        eo = torch.where(live, rows.float() * 0.5 - 0.25, 0).to(torch.bfloat16)
        gy = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        out[case, "combine"] = _opcheck(_OPS.combine.default, (eo.clone().requires_grad_(),
                                                               rw.clone().requires_grad_(), ticket, bid, T))
        out[case, "combine_backward"] = _opcheck(_OPS.combine_backward.default, (gy, eo, ticket, bid))
        for name, grad_w in (("dispatch_backward", rw.clone()), ("dispatch_backward (no weights)", None)):
            out[case, name] = _opcheck(_OPS.dispatch_backward.default, (eo, grad_w, ticket, bid, T))
        del rows, rw, pair, ticket
        buf.close()
    return out


def _check(results, cases):
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == 5 * len(cases)
        bad = {k: v for k, v in per_rank.items() if v}
        assert not bad, f"rank {rank}: " + "\n".join(f"{c} {op}: {f}" for (c, op), f in bad.items())


def test_opcheck_world1():
    """Each path once, each sync mode once (~4 s; the world of 2 runs all four cases)."""
    cases = (CASES[0], CASES[3])
    _check(run_cpu_world(1, _world, TOKENS[:1], cases, timeout_s=300), cases)


@pytest.mark.slow  # > 4 s on 2 cores (~25 s): CI's second step
def test_opcheck_world2():
    """Every case (both backends), uneven T (6 and 3 tokens)."""
    _check(run_cpu_world(2, _world, TOKENS, CASES, timeout_s=400), CASES)
