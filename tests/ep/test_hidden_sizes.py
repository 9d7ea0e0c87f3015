"""Production hidden sizes through dispatch and combine: bf16 at 2048-7168 (2880 included) and fp8 (which refuses
2880: not a multiple of its 128-wide block), bit for bit against the reference and the fp8 twin."""

import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import WireError
from tritonep.reference import combine_reference_partial, dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs
from tritonep.wire import dequantize_fp8_torch, quantize_fp8_torch

BF16 = torch.bfloat16


def _eo(x):
    """The test's expert "FFN": a deterministic elementwise function of the received rows."""
    return (x.float() * 0.5 + 1.0).to(BF16)


def _calls_world(group, cfg, calls):
    """Rank body: one buffer, every call of ``calls[rank]`` as dispatch -> _eo -> combine; returns the tensors."""
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], expert_alignment=cfg.get("A", 1),
                       backend=cfg.get("backend", "auto"), dispatch_wire=cfg.get("dwire", "bf16"))
    outs = []
    for x, idx, w in calls[rank]:
        d = buf.dispatch(x, idx, w)
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_(_eo(d.x))
        y = buf.combine(eo, d.handle)
        outs.append(dict(x=d.x.clone(), ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
                         w=d.weights.clone(), eo=eo.clone(), y=y.clone(), counts=d.handle.counts.clone()))
    buf.close()
    return outs


def _check_calls(W, cfg, calls, res, rows=None):
    """Every call of every rank against the reference; ``rows(ref_x)`` maps reference rows (wire rounding)."""
    for i in range(len(calls[0])):
        xs, idxs, ws = ([calls[r][i][j] for r in range(W)] for j in range(3))
        ref = dispatch_reference(xs, idxs, ws, cfg["E"], W, expert_alignment=cfg.get("A", 1))
        for r in range(W):
            got = res[r][i]
            want_x = ref[r].x if rows is None else rows(ref[r].x)
            for k, want in (("ntpe", ref[r].num_tokens_per_expert), ("offs", ref[r].expert_offsets),
                            ("x", want_x), ("w", ref[r].weights), ("counts", ref[r].counts)):
                assert torch.equal(got[k], want), f"call {i} rank {r}: {k} differs from the reference"
        yp = combine_reference_partial([res[r][i]["eo"] for r in range(W)], ref, idxs, ws, [len(x) for x in xs])
        for r in range(W):
            assert torch.equal(res[r][i]["y"], yp[r].to(BF16)), f"call {i} rank {r}: y differs from the reference"


HIDDEN_BF16 = [2048, 2880, 3072, 4096, 6144, 7168]


HIDDEN_FP8 = [2048, 3072, 4096, 6144, 7168]


def _hidden_world(group, hiddens, dwire):
    rank = dist.get_rank(group)
    res = {}
    for H in hiddens:
        cfg = dict(E=4, H=H, Tmax=3, K=2, dwire=dwire)
        calls = [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]
        out = _calls_world(group, cfg, calls)[0]
        if dwire != "bf16":
            buf = tep.EPBuffer(group, 4, H, 3, 2, dispatch_wire=dwire)
            dq = buf.dispatch(*calls[rank][0], keep_quantized=True)
            out["q"], out["s"] = dq.x.clone(), dq.x_scales.clone()
            buf.close()
        res[H] = out
    if dwire == "fp8":
        try:
            tep.EPBuffer(group, 4, 2880, 3, 2, dispatch_wire="fp8")
            res["2880"] = None
        except WireError as e:
            res["2880"] = str(e)
    return res


def _fp8_rows(x):
    q, s = quantize_fp8_torch(x)
    return dequantize_fp8_torch(q, s, torch.float32).to(BF16)


def test_hidden_sizes_bf16():
    res = run_cpu_world(2, _hidden_world, HIDDEN_BF16, "bf16", timeout_s=240)
    for H in HIDDEN_BF16:
        calls = [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]
        _check_calls(2, dict(E=4, H=H), calls, [[res[r][H]] for r in range(2)])


def test_hidden_sizes_fp8():
    res = run_cpu_world(2, _hidden_world, HIDDEN_FP8, "fp8", timeout_s=240)
    for H in HIDDEN_FP8:
        calls = [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]
        _check_calls(2, dict(E=4, H=H), calls, [[res[r][H]] for r in range(2)], rows=_fp8_rows)
        ref = dispatch_reference(*([c[0][j] for c in calls] for j in range(3)), 4, 2)
        for r in range(2):
            q, s = quantize_fp8_torch(ref[r].x)
            assert torch.equal(res[r][H]["q"], q.view(torch.uint8)) and torch.equal(res[r][H]["s"], s), (H, r)
    for r in range(2):
        assert res[r]["2880"] is not None and "2880" in res[r]["2880"] and "128" in res[r]["2880"]
