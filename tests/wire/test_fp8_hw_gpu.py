"""GPU (one H200): the inline-PTX fp8 fast paths give the integer path's bits (``pytest -m gpu``).

* encode: EVERY fp32 bit pattern (2^32, swept on the device, mismatches counted) through
  :func:`tritonep.wire.kernels.fp8_hw.fp8_encode_hw` and :func:`tritonep.wire.kernels.quant.fp8_encode_bits`, e4m3 and e5m2;
* decode: every 8-bit code, e4m3 and e5m2;
* block quantize (``scaled_quant_tile`` with FAST on / off, POW2 on / off: the reciprocal multiply) on all 2^16
  bf16 patterns widened, random fp32 over the whole exponent range and the specials, and the standalone
  ``quantize_fp8`` / ``dequantize_fp8`` (FAST on the GPU) against the torch twins;
* fp8 / fp8_e5m2 / mxfp4 dispatch + combine at world 1 (the kernels pass FAST=HAS_TIMER=True) against the twins.

Run: ``PYTHONPATH=. python -m pytest -q -m gpu tests/wire/test_fp8_hw_gpu.py``.
"""

import pytest
import torch

from tritonep.wire.kernels.quant import FP8_E4M3_CODEC
from tritonep.wire.kernels.quant_e5m2 import FP8_E5M2_CODEC
from tests.support.probe_fp8_hw import decode_codes_kernel, sweep_encode_kernel, tile_quant_kernel

pytestmark = pytest.mark.gpu

FORMATS = [(False, 3, 7, 0x7E), (True, 2, 15, 0x7B)]  # (E5M2, mantissa bits, bias, max code)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_encode_every_fp32_pattern(fmt):
    dev = _cuda()
    e5, mb, bias, mc = fmt
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    first = torch.full((1,), 1 << 40, dtype=torch.int64, device=dev)
    BLOCK, chunk = 4096, 1 << 30
    for base in range(0, 1 << 32, chunk):
        sweep_encode_kernel[(chunk // BLOCK,)](bad, first, base, E5M2=e5, MBITS=mb, BIAS=bias, MAXCODE=mc, BLOCK=BLOCK)
    torch.cuda.synchronize()
    assert int(bad) == 0, f"{int(bad)} patterns differ, first 0x{int(first):08x}"


@pytest.mark.parametrize("e5", [False, True], ids=["e4m3", "e5m2"])
def test_decode_every_code(e5):
    dev = _cuda()
    b = torch.arange(256, dtype=torch.int32, device=dev)
    hw, ref = torch.empty_like(b), torch.empty_like(b)
    decode_codes_kernel[(1,)](b, hw, ref, E5M2=e5)
    assert torch.equal(hw, ref), (hw != ref).nonzero().flatten().tolist()


def _tile_inputs(dev):
    g = torch.Generator().manual_seed(5)
    bf = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf_shuffled = bf[torch.randperm(bf.numel(), generator=g)]  # mixed magnitudes in one block
    rnd = torch.randint(-(1 << 31), 1 << 31, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    rnd = rnd.view(torch.float32)
    scaled = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-150, 128, (512, 1), generator=g).float()
                                                            ).repeat(1, 128).flatten()
    sp = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
                       1.17549435e-38, 3.4028235e38, -3.4028235e38, 448.0, 464.0, 57344.0, 61440.0, 1.0] * 64)
    return torch.cat([bf, bf_shuffled, rnd, scaled, sp]).reshape(-1, 128).contiguous().to(dev)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("codec", [FP8_E4M3_CODEC, FP8_E5M2_CODEC], ids=["e4m3", "e5m2"])
def test_block_quant_fast_equals_integer(codec, pow2):
    dev = _cuda()
    x = _tile_inputs(dev)
    outs = []
    for fast in (False, True):
        q = torch.empty(x.shape, dtype=torch.uint8, device=dev)
        s = torch.empty(x.shape[0], dtype=torch.float32, device=dev)
        tile_quant_kernel[(x.shape[0] // 8,)](x, q, s, POW2=pow2, FAST=fast, CODEC=codec, G=8)
        outs.append((q, s))
    assert torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
    bad = (outs[0][0] != outs[1][0]).nonzero()
    assert bad.numel() == 0, [(hex(int(x[r, c].view(torch.int32))), int(outs[0][0][r, c]), int(outs[1][0][r, c]))
                              for r, c in bad[:8].tolist()]


@pytest.mark.parametrize("wire", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
def test_standalone_quantize_matches_twin(wire, pow2):
    from tritonep.wire import get_wire
    from tritonep.wire.fp8 import scaled_dequantize, scaled_quantize

    dev = _cuda()
    codec = FP8_E4M3_CODEC if wire == "fp8" else FP8_E5M2_CODEC
    x = _tile_inputs(dev).reshape(-1, 1024)
    q, s = scaled_quantize(x, pow2, codec, "test")
    wf = get_wire(wire)
    qt, st = wf.quantize_torch(x.cpu(), pow2_scale=pow2)
    assert torch.equal(q.cpu(), qt.view(torch.uint8))
    assert torch.equal(s.cpu().view(torch.int32), st.view(torch.int32))
    out = scaled_dequantize(q, s, torch.bfloat16, codec, "test").cpu()
    want = wf.dequantize_torch(qt, st, torch.bfloat16)
    # the dequant is arithmetic (one fp32 multiply): every non-NaN value bit for bit; a NaN product (NaN codes,
    # 0 x inf scales of non-finite blocks) is NaN on both sides, but IEEE leaves its sign and payload to the
    # hardware (the GPU returns the canonical 0x7FFFFFFF, x86 the input's payload or 0xFFC00000)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    bad = (out.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not bad.any(), [(r, c, float(out[r, c]), float(want[r, c])) for r, c in bad.nonzero()[:8].tolist()]


@pytest.mark.world1
@pytest.mark.parametrize("dwire,cwire", [("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2"), ("mxfp4", "mxfp4")])
def test_wires_bit_exact_world1(gpu_world, dwire, cwire):
    from tests.support.wire_checks import check_wire_roundtrip, wire_roundtrip_world

    shape, ntok = (16, 1024, 64, 4), [61]
    res = gpu_world(1, wire_roundtrip_world, dwire, cwire, ntok, shape, timeout_s=600)
    check_wire_roundtrip(res, dwire, cwire, ntok, shape)
