"""fp8 / mxfp4 wires on the nccl (torch.distributed) backend: bit-identical to the triton backend and to the twins.

Both backends run in the same CPU world (gloo + Triton interpreter) on the same inputs: dispatch rows (bf16 and
``keep_quantized`` payload / scales), counts, offsets, weights, combine output and the backward passes (always bf16)
must be equal. Independently, the nccl results must equal the twin quantizers of :mod:`tritonep.wire` applied to
:func:`tritonep.reference.dispatch_reference` rows, and, for combine, the twin applied to every rank's fp32 partial
(k ascending, products rounded first), dequantized to fp32 and summed over ranks ascending.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.ep import EPBuffer
from tritonep.ep.nccl.backend import NcclEP
from tritonep.errors import WireError
from tritonep.reference import dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs
from tritonep.wire import dequantize_fp8_torch, dequantize_mxfp4_torch, quantize_fp8_torch, quantize_mxfp4_torch

CPU = dict(E=6, H=256, K=3, TMAX=10, A=2, seed=3)
GPU = dict(E=32, H=7168, K=8, TMAX=256, A=4, seed=4)  # DeepSeek-V3-like rows
WIRES = [("fp8", "fp8"), ("mxfp4", "mxfp4"), ("fp8", "bf16")]
TOKENS = {2: [10, 0], 3: [7, 0, 9]}  # one rank without tokens


def _inputs(rank, T, cfg):
    """x, topk_idx (with -1 slots, a token without any route, a token with one expert twice), topk_weights."""
    x, idx, w = make_rank_inputs(rank, T, cfg["H"], cfg["E"], cfg["K"], seed=cfg["seed"], mask_frac=0.25)
    if T > 2:
        idx[0] = -1
        idx[1, 2] = idx[1, 0] if idx[1, 0] >= 0 else 1
        x[2, :128] = 0  # an all-zero fp8 block, four all-zero mxfp4 blocks
    return x, idx, w


def _quant(wire, x):
    if wire == "fp8":
        q, s = quantize_fp8_torch(x)
        return q.view(torch.uint8), s
    return quantize_mxfp4_torch(x)


def _dequant(wire, q, s, dtype):
    return (dequantize_fp8_torch if wire == "fp8" else dequantize_mxfp4_torch)(q, s, dtype)


# ------------------------------------------------------------------------------------------- rank body
def _both(group, dwire, cwire, ntok, cfg, nccl_triton=False):
    rank = dist.get_rank(group)
    gpu = dist.get_backend(group) == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x0, idx, w0 = (t.to(dev) for t in _inputs(rank, ntok[rank], cfg))
    gy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(rank)).to(dev)
    res = {}
    for backend in ("triton", "nccl"):
        buf = EPBuffer(group, cfg["E"], cfg["H"], cfg["TMAX"], cfg["K"], dispatch_wire=dwire, combine_wire=cwire,
                       expert_alignment=cfg["A"], backend=backend, device=dev)
        assert buf.backend == backend
        if backend == "nccl" and nccl_triton:
            buf._impl.use_triton = True  # the combine's Triton sums (interpreted here) instead of the torch twins
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        d = buf.dispatch(x, idx, w)
        eo = (d.x.float() * 0.75 + 0.5).to(torch.bfloat16)  # padding rows nonzero: combine must ignore them
        eo.retain_grad()
        y = buf.combine(eo, d.handle)
        (y.float() * gy).sum().backward()
        dq = buf.dispatch(x0, idx, w0, keep_quantized=True)
        yq = buf.combine(eo.detach(), dq.handle)  # combine after a keep_quantized dispatch
        out = dict(x=d.x.detach(), ntpe=d.num_tokens_per_expert, offs=d.expert_offsets, weights=d.weights.detach(),
                   eo=eo.detach(), y=y.detach(), gx=x.grad, gw=w.grad, geo=eo.grad, q=dq.x, s=dq.x_scales,
                   qntpe=dq.num_tokens_per_expert, qoffs=dq.expert_offsets, qweights=dq.weights, yq=yq)
        res[backend] = {k: v.cpu() for k, v in out.items()}
        buf.close()
    return res


# ------------------------------------------------------------------------------------------- reference
def _combine_want(W, ins, ref, eos, cwire, r):
    """y of source rank r: per expert rank d ascending, fp32 partial (k ascending) -> wire -> fp32, summed."""
    T, K = ins[r][1].shape
    H = ins[r][0].shape[1]
    y = torch.zeros(T, H)
    for d in range(W):
        part = torch.zeros(T, H)
        has = torch.zeros(T, dtype=torch.bool)
        for k in range(K):
            m = (ref[d].src_rank == r) & (ref[d].src_k == k)
            tok = ref[d].src_token[m].long()
            part[tok] = part[tok] + ref[d].weights[m][:, None] * eos[d][m].float()
            has[tok] = True
        pq = part.to(torch.bfloat16).float() if cwire == "bf16" else _dequant(cwire, *_quant(cwire, part),
                                                                              torch.float32)
        y[has] = y[has] + pq[has]
    return y.to(torch.bfloat16)


def _check(res, dwire, cwire, ntok, cfg):
    W = len(ntok)
    ins = [_inputs(r, ntok[r], cfg) for r in range(W)]
    assert any(bool((i[1] == -1).any()) for i in ins)
    ref = dispatch_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], cfg["E"], W,
                             expert_alignment=cfg["A"])
    for r in range(W):
        t, n = res[r]["triton"], res[r]["nccl"]
        for key in ("x", "ntpe", "offs", "weights", "y", "gx", "geo", "q", "s", "qntpe", "qoffs", "qweights", "yq"):
            assert t[key].dtype == n[key].dtype and torch.equal(t[key], n[key]), f"rank {r}: {key} differs"
        assert torch.equal(t["gw"] == 0, n["gw"] == 0)  # fp32 dot products over H: tile order on triton
        tol = 1e-5 * cfg["H"] / 256  # rounding of an fp32 dot product over H grows with H
        torch.testing.assert_close(t["gw"], n["gw"], rtol=tol, atol=tol)
    for r in range(W):
        n = res[r]["nccl"]
        q, s = _quant(dwire, ref[r].x)
        deq = _dequant(dwire, q, s, torch.bfloat16)
        assert torch.equal(deq, _dequant(dwire, q, s, torch.float32).to(torch.bfloat16))  # fp32 then RNE
        assert torch.equal(n["x"], deq), f"rank {r}: dispatch rows differ from the twins"
        assert torch.equal(n["q"], q) and torch.equal(n["s"], s), f"rank {r}: payload / scales differ"
        pad = ref[r].src_rank < 0
        assert torch.equal(n["q"][pad], torch.zeros_like(n["q"][pad]))
        assert (n["s"][pad] == (2.0 ** -126 if dwire == "fp8" else 0)).all()
        for key, want in (("ntpe", ref[r].num_tokens_per_expert), ("offs", ref[r].expert_offsets),
                          ("weights", ref[r].weights), ("qoffs", ref[r].expert_offsets),
                          ("qweights", ref[r].weights)):
            assert torch.equal(n[key], want), f"rank {r}: {key}"
    eos = [res[d]["nccl"]["eo"] for d in range(W)]
    for r in range(W):
        want = _combine_want(W, ins, ref, eos, cwire, r)
        assert torch.equal(res[r]["nccl"]["y"], want), f"rank {r}: combine differs from the twins"
        assert torch.equal(res[r]["nccl"]["yq"], want)


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("dwire,cwire", WIRES)
def test_nccl_wires_match_triton_and_twins(dwire, cwire, W):
    ntok = TOKENS[W]
    _check(run_cpu_world(W, _both, dwire, cwire, ntok, CPU, timeout_s=300), dwire, cwire, ntok, CPU)


@pytest.mark.parametrize("dwire,cwire", WIRES)
def test_nccl_wires_triton_sums_match_triton_and_twins(dwire, cwire):
    """The combine's Triton kernels (used on CUDA; interpreted here) give the same bits on every wire."""
    ntok = TOKENS[2]
    _check(run_cpu_world(2, _both, dwire, cwire, ntok, CPU, True, timeout_s=300), dwire, cwire, ntok, CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dwire,cwire", WIRES)
def test_gpu_nccl_wires_match_triton_and_twins(gpu_world, dwire, cwire):
    ntok = [256, 200]
    _check(gpu_world(2, _both, dwire, cwire, ntok, GPU, timeout_s=300, nccl=True), dwire, cwire, ntok, GPU)


def test_unknown_wire_and_bad_hidden_raise_wire_error():
    from tritonep.ep.config import build_config

    def cfg(**kw):
        return build_config(world_size=2, num_experts=8, max_tokens_per_rank=4, topk=2, backend="nccl",
                            device_type="cpu", **{"hidden": 256, **kw})

    with pytest.raises(WireError, match="fp4"):
        cfg(dispatch_wire="fp4")
    with pytest.raises(WireError, match="combine_wire.*128"):
        cfg(hidden=96, combine_wire="fp8")
    for wire in ("fp8", "mxfp4"):  # accepted now
        ep = NcclEP(cfg(dispatch_wire=wire, combine_wire=wire), group=None, rank=0, device=torch.device("cpu"))
        assert (ep.dispatch_wire, ep.combine_wire) == (wire, wire)