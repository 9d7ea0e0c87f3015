"""Quantized wires through dispatch and combine, checked bit for bit against the reference and the twin quantizers.

:func:`wire_roundtrip_world` runs on every rank (CPU world under the interpreter, or a GPU world, where the kernels
take their inline-PTX fast paths); :func:`check_wire_roundtrip` recomputes the expected bits on the host:

* dispatch: received rows == ``dequantize_torch(quantize_torch(reference rows))`` (bf16 output), and with
  ``keep_quantized=True`` the payload and scales == the twin quantizer on the reference rows;
* combine (push): each expert rank's fp32 partial (weighted sum in k order) through the twin quantizer and back,
  summed in rank order in fp32 -- the kernels' exact order -- so the result is bit-exact too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cases import make_rank_inputs

__all__ = ["wire_roundtrip_world", "check_wire_roundtrip"]


def _qdq(wire: str, x: torch.Tensor):
    """Twin quantize + dequantize of fp32 rows ``x``: ``(fp32 rows, (payload uint8, scales))``."""
    from tritonep.wire import get_wire

    wf = get_wire(wire)
    q, s = wf.quantize_torch(x)
    return wf.dequantize_torch(q, s, torch.float32), (q.view(torch.uint8), s)


def wire_roundtrip_world(group, dwire: str, cwire: str, ntok: list, shape: tuple, seed: int = 11) -> dict:
    """Rank function: one dispatch, combine and ``keep_quantized`` dispatch with the given wires.

    Args:
        dwire / cwire: dispatch and combine wire names. ntok: tokens per rank. shape: ``(E, H, Tmax, K)``.

    Returns:
        dict of CPU tensors: x (received bf16 rows), eo (expert output used), y (combine), q / s (kept payload as
        uint8 and scales), offs (expert offsets).
    """
    import tritonep as tep
    from tritonep.kernels.common import kernels_interpreted

    E, H, TMAX, K = shape
    rank = dist.get_rank(group)
    dev = torch.device("cpu") if kernels_interpreted() else torch.device("cuda", torch.cuda.current_device())
    buf = tep.EPBuffer(group, E, H, TMAX, K, dispatch_wire=dwire, combine_wire=cwire, expert_alignment=2)
    x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, ntok[rank], H, E, K, seed=seed))
    d = buf.dispatch(x, idx, w)
    eo = buf.expert_out_buffer(d.x.shape[0])
    eo.copy_((d.x.float() * 0.75 + 0.5).to(torch.bfloat16))
    y = buf.combine(eo, d.handle)
    dq = buf.dispatch(x, idx, w, keep_quantized=True)
    # fresh copies: on the CPU the outputs can be views of the shared heap (pickling one pickles its whole storage)
    out = {k: v.to("cpu", copy=True) for k, v in dict(x=d.x, eo=eo, y=y, q=dq.x.view(torch.uint8), s=dq.x_scales,
                                                       offs=dq.expert_offsets).items()}
    buf.close()
    return out


def check_wire_roundtrip(res: list, dwire: str, cwire: str, ntok: list, shape: tuple, seed: int = 11) -> None:
    """Assert every rank's :func:`wire_roundtrip_world` result against the reference with the twin quantizers.

    Raises:
        AssertionError: naming the rank and the output that differs.
    """
    from tritonep.reference import dispatch_reference

    E, H, TMAX, K = shape
    W = len(res)
    ins = [make_rank_inputs(r, ntok[r], H, E, K, seed=seed) for r in range(W)]
    ref = dispatch_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E, W,
                             expert_alignment=2)
    for r in range(W):
        dq, (q, s) = _qdq(dwire, ref[r].x.float())
        assert torch.equal(res[r]["x"], dq.to(torch.bfloat16)), f"rank {r}: dispatched rows"
        assert torch.equal(res[r]["q"], q), f"rank {r}: kept payload"
        assert torch.equal(res[r]["s"], s), f"rank {r}: kept scales"
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
            pq = part.to(torch.bfloat16).float() if cwire == "bf16" else _qdq(cwire, part)[0]
            has = torch.tensor([any(int(e) >= 0 and int(e) // L == d for e in idx[t]) for t in range(T)])
            want += torch.where(has[:, None], pq, torch.zeros_like(pq))
        assert torch.equal(res[r]["y"], want.to(torch.bfloat16)), f"rank {r}: combine"
