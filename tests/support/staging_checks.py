"""Own-rank staging checks, shared by the CPU-world and the GPU tests (module-level: spawn imports it).

The dispatch sender does not stage its own rank's rows on any wire (the expander reads them from the sender's input
and, on a quantized wire, encodes them itself); rows for the peer are staged (encoded). :func:`own_staging_world` fills
the rank's OWN staging rows ``stage[RANK]`` (only its own sender ever writes them) with :data:`SENTINEL`, runs a
dispatch and a combine backward (send + expand with SCALE/DOT on the raw wire) and returns what the staging and
the outputs hold; :func:`check_own_staging` compares that with the reference oracles and the twin quantizers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of

__all__ = ["SENTINEL", "own_staging_world", "check_own_staging", "stage_own_pair_world"]

SENTINEL = 0xA5
"""Byte written into ``stage[RANK]`` before the dispatch (no wire row of the cases below is all 0xA5)."""


def _grad_y(rank: int, T: int, H: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(4242 + rank)
    return torch.randn(T, H, generator=g).to(torch.bfloat16)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy (``.cpu()`` of a CPU tensor is the tensor itself: a view into the heap that ``close`` frees)."""
    return t.detach().to("cpu", copy=True)


def _set_stage_own(wire: str, stage_own: bool):
    """Replace ``wire``'s codec in this process's registry by one with ``stage_own`` (returns the codec it replaced).
    The compiled kernels' key holds the whole codec (its repr), so no kernel of the other setting is reused."""
    import dataclasses

    from tritonep.wire.formats import get_wire

    fmt = get_wire(wire)
    old = fmt.codec
    object.__setattr__(fmt, "codec", dataclasses.replace(old, stage_own=stage_own))
    return old


def own_staging_world(group, wire: str, case: dict, stage_own: bool | None = None):
    """One rank of the own-staging check (CPU world or GPU world; world size 2).

    ``stage_own``: run with the wire's codec ``stage_own`` set so in this rank's process (None: the registry's
    setting; restored before returning).

    ``case``: ``E, H, Tmax, K, A`` (buffer), ``T`` (tokens per rank), ``seed``. Returns CPU tensors: the received
    rows ``x``, ``w``, ``offs``; ``own_fwd`` / ``own_bwd`` = ``stage[RANK]`` (uint8 ``[Tmax, 2H]``) after the
    dispatch / after the combine backward; ``peer`` = ``stage[1 - RANK]`` after the dispatch; ``g_eo`` / ``g_w``
    (combine backward of ``grad_y = _grad_y(rank)`` against ``eo = bf16(0.5 x - 0.25)``) and ``eo``.
    """
    import tritonep as tep

    if stage_own is not None:
        from tritonep.wire.formats import get_wire

        old = _set_stage_own(wire, stage_own)
        try:
            return own_staging_world(group, wire, case)
        finally:
            object.__setattr__(get_wire(wire), "codec", old)
    rank = dist.get_rank(group)
    c = case
    buf = tep.EPBuffer(group, c["E"], c["H"], c["Tmax"], c["K"], dispatch_wire=wire, expert_alignment=c["A"])
    dev = buf.device
    stage = backend_of(buf).buf.local("stage")  # [W, Tmax, 2H] uint8; row stage[s] is written by rank s only
    stage[rank].fill_(SENTINEL)
    x, idx, w = make_rank_inputs(rank, c["T"][rank], c["H"], c["E"], c["K"], seed=c["seed"])
    d = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    out = dict(x=_host(d.x), w=_host(d.weights), offs=_host(d.expert_offsets), own_fwd=_host(stage[rank]),
               peer=_host(stage[1 - rank]))
    dist.barrier(group)  # no peer restages (the backward send below) before both ranks copied their staging
    eo = (d.x.float() * 0.5 - 0.25).to(torch.bfloat16)
    g_eo, g_w = buf.combine_backward(_grad_y(rank, c["T"][rank], c["H"]).to(dev), eo, d.handle)
    out.update(own_bwd=_host(stage[rank]), g_eo=_host(g_eo), g_w=_host(g_w), eo=_host(eo))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    buf.close()
    return out


def _quant(wire: str, x: torch.Tensor):
    """(payload bytes, scale bytes, dequantized fp32) of the twin quantizer for rows ``x``."""
    from tritonep.wire import dequantize_fp8_torch, dequantize_mxfp4_torch, quantize_fp8_torch, quantize_mxfp4_torch

    if wire == "fp8":
        q, s = quantize_fp8_torch(x)
        return q.view(torch.uint8), s.view(torch.uint8), dequantize_fp8_torch(q, s, torch.float32)
    if wire == "mxfp4":
        q, s = quantize_mxfp4_torch(x)
        return q, s.view(torch.uint8), dequantize_mxfp4_torch(q, s, torch.float32)
    raise ValueError(f"no twin quantizer for wire {wire!r} in this check")


def check_own_staging(res: list, wire: str, case: dict, stage_own: bool | None = None):
    """Assert what :func:`own_staging_world` returned (``res[r]`` per rank) for ``wire`` (``stage_own``: as it was
    given there).

    ``stage[RANK]`` holds the sentinel everywhere (a wire whose codec has ``stage_own``: everywhere but its
    own tokens routed to its own rank, which hold the twin quantizer's bytes as a peer's would); the peer's staged
    rows routed here hold its ``x`` rows (bf16) or the twin quantizer's payload + scale bytes of them (fp8 /
    mxfp4); received rows / weights /
    offsets equal the reference bit for bit (quantized: dequantize(quantize(reference))). The (raw) combine backward
    leaves ``stage[RANK]`` as the dispatch left it; ``grad_expert_out[row] = bf16(fp32(grad_y[t]) * w)`` bit for
    bit and ``grad_recv_weights[row] = <grad_y[t], eo[row]>`` within rtol 1e-4, atol 1e-3 (fp32 dot, other order).

    Raises:
        AssertionError: naming the rank that differs.
    """
    from .harness import diff, expected
    from .wire_checks import twin_rows

    c, W = case, 2
    L, T, H = c["E"] // W, c["T"], c["H"]
    ins = [make_rank_inputs(r, T[r], H, c["E"], c["K"], seed=c["seed"]) for r in range(W)]
    xs, idxs = [i[0] for i in ins], [i[1] for i in ins]
    want = expected(ins, c["E"], c["A"], rows=None if wire == "bf16" else lambda x: twin_rows(wire, x))
    ref = [w["ref"] for w in want]

    def routed(s, r):  # [T_s] bool: token of rank s has a route on rank r
        return ((idxs[s] >= 0) & (idxs[s] // L == r)).any(1)

    from tritonep.wire.formats import get_wire

    if stage_own is None:
        stage_own = get_wire(wire).codec.stage_own

    def check_staged(r, s, rows, from_s):  # rows = the staging rows rank s wrote into rank r, routed: from_s
        staged = rows[:T[s]][from_s]
        if wire == "bf16":
            assert torch.equal(staged, xs[s][from_s].contiguous().view(torch.uint8)), r
        else:
            qp, qs, _ = _quant(wire, xs[s])
            pb, sb = qp.shape[1], qs.shape[1]
            assert torch.equal(staged[:, :pb], qp[from_s]), f"rank {r}: staged payload of {s} differs from the twin"
            assert torch.equal(staged[:, pb:pb + sb], qs[from_s]), f"rank {r}: staged scales of {s} differ"

    seen = 0  # rows the staging checks below looked at (the case must not make them vacuous)
    for r in range(W):
        got = res[r]
        assert diff(got, want[r], ("offs", "w", "x")) == [], r  # rows: the twin's round trip on quantized wires
        own = torch.zeros(got["own_fwd"].shape[0], dtype=torch.bool)
        if stage_own:  # the own tokens routed here are staged like a peer's
            own[:T[r]] = routed(r, r)
            check_staged(r, r, got["own_fwd"], own[:T[r]])
            seen += int(own.sum())
        assert bool((got["own_fwd"][~own] == SENTINEL).all()), f"rank {r}: own-rank rows were staged ({wire} wire)"
        s = 1 - r
        from_s = routed(s, r)
        seen += int(from_s.sum())
        check_staged(r, s, got["peer"], from_s)
        assert torch.equal(got["own_bwd"], got["own_fwd"]), f"rank {r}: the combine backward staged own rows"
    assert seen > 0, "the case routes no row through the checked staging rows"
    gys = [_grad_y(r, T[r], H) for r in range(W)]
    for d in range(W):
        rd, got = ref[d], res[d]
        real = rd.src_rank >= 0
        gy = torch.zeros(rd.x.shape[0], H)
        for s in range(W):
            m = real & (rd.src_rank == s)
            gy[m] = gys[s][rd.src_token[m].long()].float()
        want = torch.where(real[:, None], (gy * rd.weights[:, None]).to(torch.bfloat16), 0)
        assert torch.equal(got["g_eo"], want.to(torch.bfloat16)), f"rank {d}: grad_expert_out"
        want_w = torch.where(real, (gy * got["eo"].float()).sum(1), 0.0)
        assert torch.allclose(got["g_w"], want_w, rtol=1e-4, atol=1e-3), f"rank {d}: grad_recv_weights"


def stage_own_pair_world(group, wire: str, case: dict):
    """One rank of the stage_own comparison (any world size): the same dispatch (rows decoded, then kept
    quantized), combine and combine backward run on a buffer built with the wire's codec ``stage_own`` off, then
    on one built with it on (the codec swapped in this rank's process, restored before returning). Returns
    ``(off, on)``: dicts of CPU tensors (``x``, ``w``, ``offs``, ``q``, ``qs``, ``y``, ``g_eo``, ``g_w``), which must be
    equal bit for bit: staging the own rows or encoding them in the expander gives the same bits."""
    import tritonep as tep
    from tritonep.wire.formats import get_wire

    rank = dist.get_rank(group)
    c = case
    x, idx, w = make_rank_inputs(rank, c["T"][rank], c["H"], c["E"], c["K"], seed=c["seed"])
    got = []
    for so in (False, True):
        old = _set_stage_own(wire, so)
        try:
            buf = tep.EPBuffer(group, c["E"], c["H"], c["Tmax"], c["K"], dispatch_wire=wire,
                               expert_alignment=c["A"])
        finally:
            object.__setattr__(get_wire(wire), "codec", old)
        assert backend_of(buf).dwire.stage_own is so  # the buffer's kernels take the swapped codec
        dev = buf.device
        d = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
        out = dict(x=_host(d.x), w=_host(d.weights), offs=_host(d.expert_offsets))
        eo = (d.x.float() * 0.5 - 0.25).to(torch.bfloat16)
        out.update(y=_host(buf.combine(eo, d.handle)))
        g_eo, g_w = buf.combine_backward(_grad_y(rank, c["T"][rank], c["H"]).to(dev), eo, d.handle)
        out.update(g_eo=_host(g_eo), g_w=_host(g_w))
        k = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev), keep_quantized=True)
        out.update(q=_host(k.x), qs=_host(k.x_scales))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        buf.close()
        got.append(out)
    return tuple(got)
