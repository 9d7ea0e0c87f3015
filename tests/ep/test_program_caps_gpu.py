"""Every dispatch / combine / backward path exact at every grid a user or the platform can impose.

Two knobs set grids: ``num_sms`` (the user's SM cap: it picks paths, e.g. no fused dispatch, and caps every grid)
and ``TRITONEP_MAX_PROGRAMS`` (set for ranks that share a GPU under MPS: it only clips grids, keeping the table's
paths, so a fused dispatch runs with its roles shrunk to the cap). A kernel that assumed a minimum grid or programs
it could not have at once would be wrong (or hang) at some value; each value must give the reference's bits, or be
refused when the buffer is built. Shapes: the decode path (<= 256 tokens per rank), the two-kernel path and the
fused path (>= 1024 tokens, bf16), at the `tritonep run` model width (H 2048, 64 experts, top-6). Under MPS
(``--gpu-mps on``) a cap is never raised above the world's own share (a larger grid could starve a peer).

Selected by ``-m caps`` (scripts/gpu.sh caps); the other GPU suites leave it out.
"""

import os

import pytest
import torch

from tritonep.bench.cases import experts_for, make_rank_inputs, tokens_for
from tests.support.harness import check_calls, check_grads

pytestmark = [pytest.mark.gpu, pytest.mark.caps]

SHAPES = [
    dict(name="decode", E=64, H=2048, Tmax=64, K=6, T=[64, 17], seeds=[1]),
    dict(name="two-kernel", E=64, H=2048, Tmax=512, K=6, T=[512, 301], seeds=[2]),
    dict(name="fused", E=64, H=2048, Tmax=1024, K=6, T=[1024, 700], seeds=[3]),
]
LIMITS = [("max_programs", c) for c in (1, 2, 3, 5, 8, 13)] + [("num_sms", c) for c in (1, 3, 8, 24)]


def _sweep_world(group, shapes, limits):
    """Rank body: per shape and limit one buffer, a push and a pull call and a backward call; their records, or
    ("refused", message) when the buffer refused the limit at construction."""
    import torch.distributed as dist

    from tritonep.errors import ConfigError
    from tests.support.harness import open_buffer, run_call, run_grad_call

    rank = dist.get_rank(group)
    world_cap = int(os.environ.get("TRITONEP_MAX_PROGRAMS", "0") or 0)
    out = []
    for c in shapes:
        for what, v in limits:
            kw = {}
            if what == "max_programs":
                os.environ["TRITONEP_MAX_PROGRAMS"] = str(min(v, world_cap) if world_cap else v)
            else:
                kw["num_sms"] = v
            try:
                try:
                    buf = open_buffer(group, c, **kw)
                except ConfigError as e:
                    out.append(("refused", str(e)))
                    continue
                g = buf.tiles
                grids = dict(send=g.grid_send, expand=g.grid_expand, partial=g.grid_partial, out=g.grid_out,
                             fused=(g.fused_send, g.fused_expand), decode=g.decode, bgrid=g.bgrid)
                x, idx, w = make_rank_inputs(rank, c["T"][rank], c["H"], c["E"], c["K"], seed=c["seeds"][0])
                recs = [run_call(buf, x, idx, w, kind=kind) for kind in ("push", "pull")]
                grad = run_grad_call(buf, x, idx, w, grad_seed=99 + rank)
                buf.check()
                buf.close()
                out.append(("ok", grids, recs, grad))
            finally:
                if world_cap:
                    os.environ["TRITONEP_MAX_PROGRAMS"] = str(world_cap)
                else:
                    os.environ.pop("TRITONEP_MAX_PROGRAMS", None)
    return out


def _check(W, res):
    i = 0
    for c in SHAPES:
        case = dict(c, E=experts_for(c["E"], W), T=tokens_for(c["T"], W))
        calls = [[make_rank_inputs(r, case["T"][r], case["H"], case["E"], case["K"], seed=case["seeds"][0])]
                 for r in range(W)]
        for what, v in LIMITS:
            where = f"{c['name']} {what}={v}"
            kinds = {res[r][i][0] for r in range(W)}
            assert len(kinds) == 1, f"{where}: ranks disagree on refusing the limit: {[res[r][i] for r in range(W)]}"
            if kinds == {"refused"}:
                msg = res[0][i][1]
                assert str(v) in msg and "\n" not in msg.strip(), f"{where}: an unclear refusal: {msg!r}"
                i += 1
                continue
            for r in range(W):
                grids = res[r][i][1]
                biggest = max(grids["send"], grids["expand"], grids["partial"], grids["out"], sum(grids["fused"]),
                              grids["decode"], grids["bgrid"])
                assert biggest <= v, f"{where} rank {r}: a grid above the limit: {grids}"
            for k, kind in enumerate(("push", "pull")):
                check_calls(dict(case, kind=kind), calls, [[res[r][i][2][k]] for r in range(W)])
            check_grads(case["E"], [res[r][i][3] for r in range(W)], where=where)
            i += 1


def test_program_caps_exact_world1(gpu_world):
    """One rank, the whole GPU: every limit exact (or refused at construction)."""
    shapes = [dict(c, T=tokens_for(c["T"], 1)) for c in SHAPES]
    _check(1, gpu_world(1, _sweep_world, shapes, LIMITS, timeout_s=600))


test_program_caps_exact_world1 = pytest.mark.world1(test_program_caps_exact_world1)


def test_program_caps_exact(gpu_world, gpu_world_size):
    """``gpu_world_size`` ranks sharing the GPU (time-sliced, or at once under ``--gpu-mps on``)."""
    W = gpu_world_size
    shapes = [dict(c, E=experts_for(c["E"], W), T=tokens_for(c["T"], W)) for c in SHAPES]
    _check(W, gpu_world(W, _sweep_world, shapes, LIMITS, timeout_s=600))
