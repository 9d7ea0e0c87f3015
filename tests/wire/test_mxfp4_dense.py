"""mxfp4 Triton encoder / decoder (interpreter) against the torch twins on dense inputs: every bf16 pattern, values
exactly on the e2m1 midpoints (ties) and one ulp either side at scales from fp32-subnormal to the top of the range,
the specials; every (packed byte, e8m0 scale) pair through the decoder, in order, shuffled, and the normal scales
alone; the same on the GPU (gpu marker)."""

import pytest
import torch

from tritonep.wire.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_torch, quantize_mxfp4, quantize_mxfp4_torch


def _encode_inputs():
    g = torch.Generator().manual_seed(0)
    bf = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().reshape(-1, 1024)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.99])
    rows = []
    for e in [-149, -140, -130, -127, -126, -125, -124, -123, -100, -3, 0, 5, 100, 120, 124, 125]:
        base = mids * 2.0 ** e
        v = torch.cat([base, torch.nextafter(base, torch.full_like(base, float("inf"))),
                       torch.nextafter(base, torch.zeros_like(base))])[:31]
        v = torch.cat([v, torch.tensor([7.5 * 2.0 ** e])])  # sets the block's scale to 2^e
        rows.append(v * torch.where(torch.rand(32, generator=g) < 0.5, -1.0, 1.0))
    ties = torch.stack(rows).reshape(-1, 64)
    rnd = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-140, 120, (64, 1), generator=g).float())
    sp = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38] * 4).reshape(1, 32)
    return [bf, ties, rnd, sp]


def test_encode_dense_matches_twin():
    for x in _encode_inputs():
        x = x.float().contiguous()
        for got, want in zip(quantize_mxfp4(x), quantize_mxfp4_torch(x)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), x.shape


def test_decode_every_byte_and_scale_matches_twin():
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    packed = torch.cat([allb.reshape(16, 16)] * 256)  # 4096 blocks: every byte under every scale
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(16)
    normal = (scales >= 2) & (scales <= 252)
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(1))
    for sel in (torch.arange(4096), perm, torch.nonzero(normal).flatten()):
        p = packed[sel].reshape(-1, 8 * 16).contiguous()
        s = scales[sel].reshape(-1, 8).contiguous()
        got = dequantize_mxfp4(p, s, torch.float32).view(torch.int32)
        assert torch.equal(got, dequantize_mxfp4_torch(p, s, torch.float32).view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_on_cuda_matches_twin():
    """The compiled kernels on the GPU give the twin's bits on the same dense inputs: the encode's scaling multiply
    and the decode's one multiply keep fp32 subnormals (scales 2^-127, blocks of subnormal x) and round nothing."""
    for x in _encode_inputs():
        x = x.float().contiguous()
        for got, want in zip(quantize_mxfp4(x.cuda()), quantize_mxfp4_torch(x)):
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), x.shape
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    p = torch.cat([allb.reshape(16, 16)] * 256).reshape(-1, 8 * 16).contiguous()
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(16).reshape(-1, 8).contiguous()
    got = dequantize_mxfp4(p.cuda(), s.cuda(), torch.float32).cpu().view(torch.int32)
    assert torch.equal(got, dequantize_mxfp4_torch(p, s, torch.float32).view(torch.int32))
