"""Quantized wires through dispatch and combine, checked bit for bit against the reference and the twin quantizers.

The wire side of the harness (:mod:`.harness`): what a wire delivers is the twin of :mod:`tritonep.wire` applied to
what :mod:`tritonep.reference` says:

* dispatch: received rows == ``dequantize_torch(quantize_torch(reference rows))`` (fp32, then RNE to bf16:
  :func:`twin_rows`), and with ``keep_quantized=True`` the payload and scales == the twin quantizer on the reference
  rows, padding rows the encoding of a zero row (``WireFormat.empty_quantized``);
* combine: each expert rank's fp32 partial (weighted sum in k order) through the twin quantizer and back, summed in
  rank order in fp32 -- the kernels' exact order -- so the result is bit-exact too (:func:`combine_wire_reference`).

Rank bodies (module-level: spawned GPU ranks import them): :func:`wire_roundtrip_world` (one buffer, the buffer's
backend; CPU or GPU world, where the kernels take their inline-PTX fast paths) and :func:`both_backends_world` (the
same inputs on the triton and the nccl backend, with the backward passes); :func:`check_wire_roundtrip` and
:func:`check_both_backends` compare on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of

__all__ = ["twin_rows", "twin_payload", "combine_wire_reference", "wire_roundtrip_world", "check_wire_roundtrip",
           "CPU_CASE", "GPU_CASE", "CASE_TOKENS", "wire_case_inputs", "both_backends_world", "check_both_backends"]

CPU_CASE = dict(E=6, H=256, K=3, Tmax=10, A=2, seed=3)
"""The wire case of the CPU worlds (:func:`both_backends_world`)."""
GPU_CASE = dict(E=32, H=7168, K=8, Tmax=256, A=4, seed=4)
"""The wire case of the GPU worlds: DeepSeek-V3-like rows."""
CASE_TOKENS = {2: [10, 0], 3: [7, 0, 9]}
"""Tokens per rank of the CPU wire worlds of 2 and 3 ranks (one rank without tokens)."""


def twin_rows(wire: str, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What ``wire`` delivers for rows ``x`` ``[N, H]``: the twin's quantize -> dequantize to fp32, then ``dtype``
    (a raw wire: ``x`` rounded to bf16)."""
    from tritonep.wire import get_wire

    f = get_wire(wire)
    if not f.quantized:
        return x.to(torch.bfloat16).to(dtype)
    q, s = f.quantize_torch(x)
    return f.dequantize_torch(q, s, torch.float32).to(dtype)


def twin_payload(wire: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin quantizer's ``(payload as uint8 [N, payload_bytes], scales [N, num_scales])`` of rows ``x``."""
    from tritonep.wire import get_wire

    q, s = get_wire(wire).quantize_torch(x)
    return q.view(torch.uint8), s


def combine_wire_reference(ref, eos, topk_idxs, wire: str) -> list[torch.Tensor]:
    """Every source rank's combine ``[T_r, H]`` bf16 on the combine wire ``wire``: per expert rank d ascending, the
    fp32 partial (k ascending, each product rounded to fp32 first) -> :func:`twin_rows` in fp32 -> summed in fp32.

    Args:
        ref: :func:`tritonep.reference.dispatch_reference` of the call (which row holds which route, its weight).
        eos: per expert rank the expert output ``[R_d, H]`` the ranks combined. topk_idxs: per source rank ``[T, K]``.
    """
    W = len(ref)
    out = []
    for r in range(W):
        T, K = topk_idxs[r].shape
        H = eos[0].shape[1]
        y = torch.zeros(T, H)
        for d in range(W):
            part, has = torch.zeros(T, H), torch.zeros(T, dtype=torch.bool)
            for k in range(K):
                m = (ref[d].src_rank == r) & (ref[d].src_k == k)
                tok = ref[d].src_token[m].long()
                part[tok] = part[tok] + ref[d].weights[m][:, None] * eos[d][m].float()
                has[tok] = True
            y[has] = y[has] + twin_rows(wire, part, torch.float32)[has]
        out.append(y.to(torch.bfloat16))
    return out


def wire_roundtrip_world(group, dwire: str, cwire: str, ntok: list, shape: tuple, seed: int = 11) -> dict:
    """Rank function: one dispatch, combine and ``keep_quantized`` dispatch with the given wires.

    Args:
        dwire / cwire: dispatch and combine wire names. ntok: tokens per rank. shape: ``(E, H, Tmax, K)``.

    Returns:
        dict of CPU tensors: x (received bf16 rows), eo (expert output used), y (combine), q / s (kept payload as
        uint8 and scales), offs (expert offsets).
    """
    import tritonep as tep
    from tritonep.device.common import kernels_interpreted

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
    from .harness import expected

    E, H, TMAX, K = shape
    W = len(res)
    ins = [make_rank_inputs(r, ntok[r], H, E, K, seed=seed) for r in range(W)]
    ref = [w["ref"] for w in expected(ins, E, 2)]
    for r in range(W):
        q, s = twin_payload(dwire, ref[r].x.float())
        assert torch.equal(res[r]["x"], twin_rows(dwire, ref[r].x.float())), f"rank {r}: dispatched rows"
        assert torch.equal(res[r]["q"], q), f"rank {r}: kept payload"
        assert torch.equal(res[r]["s"], s), f"rank {r}: kept scales"
        assert torch.equal(res[r]["offs"], ref[r].expert_offsets), f"rank {r}: offsets"
    ys = combine_wire_reference(ref, [res[d]["eo"] for d in range(W)], [i[1] for i in ins], cwire)
    for r in range(W):
        assert torch.equal(res[r]["y"], ys[r]), f"rank {r}: combine"


def wire_case_inputs(rank: int, T: int, cfg: dict):
    """``(x, topk_idx, topk_weights)`` of a wire case (keys E, H, K, seed) with -1 slots, a token without any route,
    a token with one expert twice and an all-zero block (one fp8 block, four mxfp4 blocks) when ``T > 2``."""
    x, idx, w = make_rank_inputs(rank, T, cfg["H"], cfg["E"], cfg["K"], seed=cfg["seed"], mask_frac=0.25)
    if T > 2:
        idx[0] = -1
        idx[1, 2] = idx[1, 0] if idx[1, 0] >= 0 else 1
        x[2, :128] = 0
    return x, idx, w


def both_backends_world(group, dwire: str, cwire: str, ntok: list, cfg: dict, nccl_triton: bool = False) -> dict:
    """Rank function: the same :func:`wire_case_inputs` through the triton and the nccl backend (case keys E, H, K,
    Tmax, A, seed): dispatch -> ``bf16(0.75 x + 0.5)`` -> combine -> backward, then a ``keep_quantized`` dispatch
    and a combine after it. ``nccl_triton``: the nccl combine's Triton sums instead of its torch twins.

    Returns:
        ``{backend: {x, ntpe, offs, weights, eo, y, gx, gw, geo, q, s, qntpe, qoffs, qweights, yq}}`` (CPU tensors).
    """
    from tritonep.ep import EPBuffer

    rank = dist.get_rank(group)
    gpu = dist.get_backend(group) == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x0, idx, w0 = (t.to(dev) for t in wire_case_inputs(rank, ntok[rank], cfg))
    gy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(rank)).to(dev)
    res = {}
    for backend in ("triton", "nccl"):
        buf = EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], dispatch_wire=dwire, combine_wire=cwire,
                       expert_alignment=cfg["A"], backend=backend, device=dev)
        assert buf.backend == backend
        if backend == "nccl" and nccl_triton:
            backend_of(buf).use_triton = True  # the combine's Triton sums (interpreted on a CPU) instead of the torch twins
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
        res[backend] = {k: v.to("cpu", copy=True) for k, v in out.items()}
        buf.close()
    return res


_BOTH = ("x", "ntpe", "offs", "weights", "y", "gx", "geo", "q", "s", "qntpe", "qoffs", "qweights", "yq")


def check_both_backends(res: list, dwire: str, cwire: str, ntok: list, cfg: dict) -> None:
    """Assert :func:`both_backends_world`'s results: the two backends agree on every output (weight gradients, fp32
    dot products over H in the triton kernel's tile order, within ``1e-5 * H / 256``), and the nccl results equal
    the reference with the wire twins (rows, kept payload / scales, padding rows, layout, weights, both combines).

    Raises:
        AssertionError: naming the rank and the output that differs.
    """
    from tritonep.wire import get_wire

    from .harness import expected

    W = len(ntok)
    ins = [wire_case_inputs(r, ntok[r], cfg) for r in range(W)]
    assert any(bool((i[1] == -1).any()) for i in ins)
    want = expected(ins, cfg["E"], cfg["A"])
    f = get_wire(dwire)
    for r in range(W):
        t, n = res[r]["triton"], res[r]["nccl"]
        for key in _BOTH:
            assert t[key].dtype == n[key].dtype and torch.equal(t[key], n[key]), f"rank {r}: {key} differs"
        assert torch.equal(t["gw"] == 0, n["gw"] == 0)  # the same routes, the same masked zeros
        tol = 1e-5 * cfg["H"] / 256  # rounding of an fp32 dot product over H grows with H
        torch.testing.assert_close(t["gw"], n["gw"], rtol=tol, atol=tol)
        ref = want[r]["ref"]
        assert torch.equal(n["x"], twin_rows(dwire, ref.x)), f"rank {r}: dispatch rows differ from the twins"
        if f.quantized:
            q, s = twin_payload(dwire, ref.x)
            assert torch.equal(n["q"], q) and torch.equal(n["s"], s), f"rank {r}: payload / scales differ"
            pad = ref.src_rank < 0
            zq, zs = f.empty_quantized(int(pad.sum()), cfg["H"], "cpu")
            assert torch.equal(n["q"][pad], zq) and torch.equal(n["s"][pad], zs), "padding rows: a zero row's encoding"
        for key, field in (("ntpe", "ntpe"), ("offs", "offs"), ("weights", "w"), ("qntpe", "ntpe"),
                           ("qoffs", "offs"), ("qweights", "w")):
            assert torch.equal(n[key], want[r][field]), f"rank {r}: {key}"
    ys = combine_wire_reference([w["ref"] for w in want], [res[d]["nccl"]["eo"] for d in range(W)],
                                [i[1] for i in ins], cwire)
    for r in range(W):
        assert torch.equal(res[r]["nccl"]["y"], ys[r]), f"rank {r}: combine differs from the twins"
        assert torch.equal(res[r]["nccl"]["yq"], ys[r])
