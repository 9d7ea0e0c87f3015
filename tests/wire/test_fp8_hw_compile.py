"""The inline-PTX fp8 fast paths (tritonep/wire/kernels/fp8_hw.py) compile for sm_90, checked offline without a GPU.

The EP kernels' FAST variants are compiled by tests/backends/test_compile_sm90.py (every recorded launch again with
HAS_TIMER=True, which selects FAST); this adds the standalone quantize / dequantize kernels and the kernels of the
GPU test (tests/support/probe_fp8_hw.py), including tiles smaller than one element per thread per pack.
"""

import pytest

from tests.support.compile_check import compile_recorded

pytestmark = pytest.mark.compile  # CI's second step (.ci/run)

_FP8 = [{"wire_codec": "fp8"}, {"wire_codec": "fp8_e5m2"}]


def _records():
    recs = []
    for e5, mb, bias, mc in ((False, 3, 7, 0x7E), (True, 2, 15, 0x7B)):
        recs.append(dict(module="tests.support.probe_fp8_hw", name="sweep_encode_kernel",
                         signature=dict(bad_ptr="*i32", first_ptr="*i64", base="i64", E5M2="constexpr",
                                        MBITS="constexpr", BIAS="constexpr", MAXCODE="constexpr", BLOCK="constexpr"),
                         constexprs=dict(E5M2=e5, MBITS=mb, BIAS=bias, MAXCODE=mc, BLOCK=4096), options={}))
        recs.append(dict(module="tests.support.probe_fp8_hw", name="decode_codes_kernel",
                         signature=dict(b_ptr="*i32", hw_ptr="*i32", ref_ptr="*i32", E5M2="constexpr"),
                         constexprs=dict(E5M2=e5), options={}))
    for codec in _FP8:
        for pow2 in (False, True):
            for g, warps in ((8, 4), (1, 8)):
                recs.append(dict(module="tests.support.probe_fp8_hw", name="tile_quant_kernel",
                                 signature=dict(x_ptr="*fp32", q_ptr="*u8", s_ptr="*fp32", POW2="constexpr",
                                                FAST="constexpr", CODEC="constexpr", G="constexpr"),
                                 constexprs=dict(POW2=pow2, FAST=True, CODEC=codec, G=g),
                                 options=dict(num_warps=warps)))
            recs.append(dict(module="tritonep.wire.kernels.wire_quant", name="fp8_quant_kernel",
                             signature=dict(x_ptr="*i16", q_ptr="*u8", s_ptr="*fp32", N="i32", H="i32",
                                            KIND="constexpr", POW2="constexpr", R="constexpr", G="constexpr",
                                            BLK="constexpr", CODEC="constexpr", FAST="constexpr"),
                             constexprs=dict(KIND=1, POW2=pow2, R=1, G=8, BLK=128, CODEC=codec, FAST=True),
                             options={}))
        recs.append(dict(module="tritonep.wire.kernels.wire_quant", name="fp8_dequant_kernel",
                         signature=dict(q_ptr="*u8", s_ptr="*fp32", o_ptr="*i16", N="i32", H="i32",
                                        KIND="constexpr", R="constexpr", G="constexpr", BLK="constexpr",
                                        CODEC="constexpr", FAST="constexpr"),
                         constexprs=dict(KIND=1, R=1, G=8, BLK=128, CODEC=codec, FAST=True), options={}))
    return recs


def test_fp8_fast_paths_compile_for_sm90():
    failures = compile_recorded(_records())
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)
