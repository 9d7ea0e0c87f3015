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
from tritonep.reference import dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs
from tritonep.wire import (dequantize_fp8_torch, dequantize_mxfp4_torch, quantize_fp8_torch,
                           quantize_mxfp4_torch)

E, H, TMAX, K = 8, 256, 12, 3


def _qdq(wire, x):
    if wire == "fp8":
        q, s = quantize_fp8_torch(x)
        return dequantize_fp8_torch(q, s, torch.float32), (q.view(torch.uint8), s)
    q, s = quantize_mxfp4_torch(x)
    return dequantize_mxfp4_torch(q, s, torch.float32), (q, s)


def _wire_world(group, dwire, cwire, ntok):
    rank = dist.get_rank()
    buf = tep.EPBuffer(group, E, H, TMAX, K, dispatch_wire=dwire, combine_wire=cwire, expert_alignment=2)
    x, idx, w = make_rank_inputs(rank, ntok[rank], H, E, K, seed=11)
    d = buf.dispatch(x, idx, w)
    eo = buf.expert_out_buffer(d.x.shape[0])
    eo.copy_((d.x.float() * 0.75 + 0.5).to(torch.bfloat16))
    y = buf.combine(eo, d.handle)
    dq = buf.dispatch(x, idx, w, keep_quantized=True)
    out = dict(x=d.x.clone(), eo=eo.clone(), y=y.clone(), q=dq.x.clone(), s=dq.x_scales.clone(),
               offs=dq.expert_offsets.clone())
    buf.close()
    return out


@pytest.mark.parametrize("dwire,cwire", [("fp8", "fp8"), ("mxfp4", "mxfp4"), ("fp8", "bf16")])
def test_wires_bit_exact(dwire, cwire):
    W, ntok = 2, [12, 5]
    res = run_cpu_world(W, _wire_world, dwire, cwire, ntok, timeout_s=300)
    ins = [make_rank_inputs(r, ntok[r], H, E, K, seed=11) for r in range(W)]
    ref = dispatch_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E, W,
                             expert_alignment=2)
    for r in range(W):
        dq, (q, s) = _qdq(dwire, ref[r].x)
        assert torch.equal(res[r]["x"], dq.to(torch.bfloat16)), r
        assert torch.equal(res[r]["q"], q), r
        assert torch.equal(res[r]["s"], s), r
    # combine: exact order of the kernels with the twin quantizer on each fp32 partial
    L = E // W
    for r in range(W):
        idx, w = ins[r][1], ins[r][2]
        T = idx.shape[0]
        want = torch.zeros(T, H)
        for d in range(W):
            part = torch.zeros(T, H)
            for t in range(T):
                for k in range(K):
                    e = int(idx[t, k])
                    if e >= 0 and e // L == d:
                        rows = ref[d]
                        row = [i for i in range(rows.x.shape[0]) if int(rows.src_rank[i]) == r
                               and int(rows.src_token[i]) == t and int(rows.src_k[i]) == k][0]
                        part[t] += (w[t, k] * res[d]["eo"][row].float())
            if cwire == "bf16":
                pq = part.to(torch.bfloat16).float()
            else:
                pq, _ = _qdq(cwire, part)
            has = torch.tensor([any(int(e) >= 0 and int(e) // L == d for e in idx[t]) for t in range(T)])
            want += torch.where(has[:, None], pq, torch.zeros_like(pq))
        assert torch.equal(res[r]["y"], want.to(torch.bfloat16)), r


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
