"""fp8 / mxfp4 wires in dispatch and combine (triton backend, CPU world) against reference + twin quantizers.

Dispatch: the received rows equal ``dequantize(quantize(reference rows))`` bit for bit (bf16 output), and with
``keep_quantized=True`` the payload and scales equal the twin quantizer applied to the reference rows.
Combine (push): each expert rank's fp32 partial is quantized with the twin, dequantized, and the partials summed in
rank order in fp32 — the exact kernel order — so the result is bit-exact too.
"""


import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import WireError
from tritonep.testing import run_cpu_world
from tests.support.harness import BF16, check_calls, run_call
from tests.support.wire_checks import check_wire_roundtrip, twin_rows, wire_roundtrip_world

SHAPE = (8, 256, 12, 3)  # E, H, Tmax, K


@pytest.mark.parametrize("dwire,cwire", [("fp8", "fp8"), ("mxfp4", "mxfp4"), ("fp8", "bf16")])
def test_wires_bit_exact(dwire, cwire):
    W, ntok = 2, [12, 5]
    res = run_cpu_world(W, wire_roundtrip_world, dwire, cwire, ntok, SHAPE, timeout_s=300)
    check_wire_roundtrip(res, dwire, cwire, ntok, SHAPE)


def _bad_wire(group):
    errs = []
    for kw in (dict(dispatch_wire="fp4"), dict(hidden=2880, dispatch_wire="fp8"), dict(hidden=48, combine_wire="mxfp4")):
        args = dict(num_experts=4, hidden=256, max_tokens_per_rank=4, topk=2)
        args.update(kw)
        try:
            tep.EPBuffer(group, **args)
            errs.append(None)
        except WireError as e:
            errs.append(str(e))
    return errs


def test_bad_wire_names_and_hidden():
    errs = run_cpu_world(2, _bad_wire, timeout_s=60)[0]
    assert "fp4" in errs[0] and "bf16" in errs[0] and "mxfp4" in errs[0]
    assert "2880" in errs[1] and "128" in errs[1]
    assert "48" in errs[2] and "32" in errs[2]


def _empty_quantized_world(group, wire):
    rank = dist.get_rank(group)
    H = 256
    buf = tep.EPBuffer(group, 4, H, 4, 2, dispatch_wire=wire)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank)).to(BF16)
    idx, w = torch.tensor([[0, 1]] * 4), torch.rand(4, 2, generator=torch.Generator().manual_seed(3))
    dq = buf.dispatch(x, idx, w, keep_quantized=True)  # experts 0, 1 live on rank 0: rank 1 receives nothing
    rec = run_call(buf, x, idx, w, fn=_identity)
    out = dict(q=(dq.x.dtype, tuple(dq.x.shape)), s=(dq.x_scales.dtype, tuple(dq.x_scales.shape)),
               x=(rec["x"].dtype, tuple(rec["x"].shape)), w=tuple(rec["w"].shape), ntpe=rec["ntpe"].tolist(),
               call=(x, idx, w), rec=rec)
    buf.close()
    return out


def _identity(x):
    return x


@pytest.mark.parametrize("wire,q_cols,s_dtype,s_cols", [("fp8", 256, torch.float32, 2),
                                                        ("mxfp4", 128, torch.uint8, 8)])
def test_quantized_dispatch_to_rank_with_no_rows(wire, q_cols, s_dtype, s_cols):
    res = run_cpu_world(2, _empty_quantized_world, wire, timeout_s=120)
    e = res[1]
    assert e["q"] == (torch.uint8, (0, q_cols)) and e["s"] == (s_dtype, (0, s_cols)), (e["q"], e["s"])
    assert e["x"] == (BF16, (0, 256)) and e["w"] == (0,) and e["ntpe"] == [0, 0]
    assert res[0]["q"] == (torch.uint8, (16, q_cols)) and res[0]["ntpe"] == [8, 8]
    # rows as the wire delivers them; y of both ranks: sum_k w * row over the received rows, in the kernels' order
    check_calls(dict(E=4), [[r["call"]] for r in res], [[r["rec"]] for r in res],
                rows=lambda x: twin_rows(wire, x.float()))
