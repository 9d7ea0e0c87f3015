"""fp8 / mxfp4 wires in dispatch and combine (triton backend, CPU world) against reference + twin quantizers.

Dispatch: the received rows equal ``dequantize(quantize(reference rows))`` bit for bit (bf16 output), and with
``keep_quantized=True`` the payload and scales equal the twin quantizer applied to the reference rows.
Combine (push): each expert rank's fp32 partial is quantized with the twin, dequantized, and the partials summed in
rank order in fp32 — the exact kernel order — so the result is bit-exact too.
"""

import pytest

import tritonep as tep
from tritonep.errors import WireError
from tritonep.testing import run_cpu_world
from tritonep.testing.wire_checks import check_wire_roundtrip, wire_roundtrip_world

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
