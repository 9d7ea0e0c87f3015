"""Production hidden sizes through dispatch and combine: bf16 at 2048-7168 (2880 included) and fp8 (which refuses
2880: not a multiple of its 128-wide block), bit for bit against the reference and the fp8 twin."""

import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import WireError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, calls_world, check_calls, expected
from tritonep.wire import dequantize_fp8_torch, quantize_fp8_torch

HIDDEN_BF16 = [2048, 2880, 3072, 4096, 6144, 7168]
HIDDEN_FP8 = [2048, 3072, 4096, 6144, 7168]


def _calls(H):
    return [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]


def _hidden_world(group, hiddens, dwire):
    rank = dist.get_rank(group)
    res = {}
    for H in hiddens:
        calls = _calls(H)
        out = calls_world(group, dict(E=4, H=H, Tmax=3, K=2, dwire=dwire), calls)[0]
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
        check_calls(dict(E=4), _calls(H), [[res[r][H]] for r in range(2)])


def test_hidden_sizes_fp8():
    res = run_cpu_world(2, _hidden_world, HIDDEN_FP8, "fp8", timeout_s=240)
    for H in HIDDEN_FP8:
        calls = _calls(H)
        check_calls(dict(E=4), calls, [[res[r][H]] for r in range(2)], rows=_fp8_rows)
        want = expected([c[0] for c in calls], 4)
        for r in range(2):
            q, s = quantize_fp8_torch(want[r]["x"])
            assert torch.equal(res[r][H]["q"], q.view(torch.uint8)) and torch.equal(res[r][H]["s"], s), (H, r)
    for r in range(2):
        assert res[r]["2880"] is not None and "2880" in res[r]["2880"] and "128" in res[r]["2880"]
