"""The torch.distributed backend of EPBuffer (NCCL on GPU, gloo on CPU): same API and bit-identical results.

For groups whose ranks cannot map each other's memory (several hosts, no P2P). Every step is a pure-torch op or a
``torch.distributed`` collective on the current stream; the row layout is the one of the triton backend by
construction (it is computed by the same torch twins, :func:`tritonep.kernels.layout.layout_torch` and
:func:`tritonep.kernels.layout.route_rows_torch`).

Dispatch (one host sync, after the counts exchange):

1. ``counts_torch`` -> this rank's routes per expert ``[E]`` and tokens per destination rank ``[W]``;
   one ``all_gather`` -> the ``[W, E + W]`` matrix on every rank (read on the host).
2. ``layout_torch`` (identical on every rank) -> capacity check: if any rank would receive more than
   ``max_recv_tokens`` rows, every rank raises :class:`CapacityError` before any row moves.
3. Pack ONE packet per (token, destination rank) with a route there, ordered by (destination rank, token): the
   token's K destination rows there (``route_rows_torch``; -1 for routes elsewhere), K weights (0 elsewhere) and
   the token's wire row, as one ``uint8`` row; move all packets with one ``all_to_all_single`` with uneven splits.
4. Scatter every received packet to its destination rows (padding rows are zero).

Wires (``dispatch_wire`` / ``combine_wire``; byte layout of :mod:`tritonep.kernels.wirecodec`, bits of the twins
in :mod:`tritonep.wire`, so both backends give identical results):

* bf16: the row's 2H bytes.
* fp8 / mxfp4 dispatch: every token row is quantized ONCE on the sender with :func:`quantize_fp8_torch` (e4m3 +
  one fp32 scale per 128) / :func:`quantize_mxfp4_torch` (packed e2m1 + one e8m0 per 32); payload then scale
  bytes follow the routing fields in the packet. The receiver writes ``dequantize_*_torch(q, s, bfloat16)`` (fp32
  dequant, round-to-nearest-even cast) into the expert rows; with ``keep_quantized=True`` it returns the payload
  rows (fp8 uint8 ``[R, H]``, mxfp4 uint8 ``[R, H/2]``) and scales (fp32 ``[R, H/128]`` / uint8 ``[R, H/32]``);
  padding rows hold the encoding of a zero row (fp8: q 0, scale 2^-126; mxfp4: 0, e8m0 0).
* fp8 / mxfp4 combine: the fp32 partial below is quantized with the twin (not rounded to bf16 first), moved,
  dequantized to fp32 on the source and summed as below.
* Backward passes always move bf16.

Combine (one ``all_to_all_single``): on the expert rank, per received packet, ``partial = 0 + sum_{k ascending,
route here} fp32(w * expert_out[row])`` in fp32 (each product rounded before the add), then rounded to the element
dtype (bf16 wire; round-to-nearest-even, torch's cast) or quantized (fp8 / mxfp4 wire); the partials go back
along the reverse splits; the source sums them (widened to fp32) in rank order in fp32 and casts (exactly
:func:`tritonep.reference.combine_reference_partial` for bf16, and the triton combine kernels for every wire).

Hierarchical multi-host (not implemented; where it would go): a two-level exchange as in DeepEP's internode
kernels -- (a) ``all_to_all_single`` inside a node group keyed by the destination's local index, sending one packet
per (token, destination NODE) to the peer with the same local index on that node over the inter-node group
(``dist.new_group`` per local index), (b) an intra-node forward (NVLink / triton backend) fanning the packet out to
the destination ranks of that node. The layout (step 2) stays global, so the rows and the bit-exact summation order
are unchanged; combine reduces per rank, then per node in rank order (the partial sum order must keep ranks
ascending, so a node-level pre-sum is only legal for contiguous rank ranges and must round per rank first).

Graph capture is refused: uneven splits need host sizes. Idea sources: DeepEP "normal" (host-synchronised) kernels,
Megatron-LM's ``MoEAlltoAllTokenDispatcher`` (counts all_to_all, then uneven token all_to_all); quantize once per
token before the all_to_all as DeepEP's fp8 dispatch does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import BackendError, BufferStateError, CapacityError
from ..kernels.layout import counts_torch, layout_torch, route_rows_torch
from ..wire.formats import check_wire, num_scales, payload_bytes, scale_bytes, scale_dtype
from ..wire.fp8 import dequantize_fp8_torch, quantize_fp8_torch
from ..wire.mxfp4 import dequantize_mxfp4_torch, quantize_mxfp4_torch
from .handle import DispatchHandle

__all__ = ["NcclEP"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` contiguous tensor -> ``[N, bytes per row]`` uint8 view."""
    cols = 1
    for n in t.shape[1:]:
        cols *= n
    return t.contiguous().reshape(t.shape[0], cols).view(torch.uint8)


def _unbytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """``[N, cols * itemsize]`` uint8 (any strides) -> ``[N, cols]`` of ``dtype`` (a copy)."""
    return b.contiguous().view(dtype).reshape(b.shape[0], cols)


def _encode(wire: str, x: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` rows -> ``[N, row bytes]`` uint8 wire rows.

    bf16: the raw bytes of ``x`` (already in the element dtype); fp8 / mxfp4: the twin quantizer applied to ``x``
    (any float dtype; an fp32 ``x`` is quantized as is), payload bytes then scale bytes.
    """
    if wire == "bf16":
        return _bytes(x)
    if wire == "fp8":
        q, s = quantize_fp8_torch(x)
        q = q.view(torch.uint8)
    else:
        q, s = quantize_mxfp4_torch(x)
    return torch.cat([q, _bytes(s)], 1)


def _split(wire: str, b: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, >= row bytes]`` uint8 fp8 / mxfp4 wire rows -> ``(payload uint8 [N, P], scales [N, S])`` (copies)."""
    p, nb = payload_bytes(wire, hidden), scale_bytes(wire, hidden)
    return b[:, :p].contiguous(), _unbytes(b[:, p:p + nb], scale_dtype(wire), num_scales(wire, hidden))


def _decode(wire: str, b: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, >= row bytes]`` uint8 wire rows -> ``[N, H]`` of ``dtype``: bf16-wire rows are the raw bytes of rows of
    ``dtype``; fp8 / mxfp4 rows are dequantized by the twin straight to ``dtype`` (fp32 value, one
    round-to-nearest-even cast)."""
    if wire == "bf16":
        return _unbytes(b[:, :hidden * dtype.itemsize], dtype, hidden)
    q, s = _split(wire, b, hidden)
    if wire == "fp8":
        return dequantize_fp8_torch(q, s, dtype)
    return dequantize_mxfp4_torch(q, s, dtype)


def _row_bytes(wire: str, hidden: int) -> int:
    """Bytes of one wire row (payload + scales)."""
    return payload_bytes(wire, hidden) + scale_bytes(wire, hidden)


class NcclEP:
    """torch.distributed implementation behind :class:`tritonep.EPBuffer` (same interface as ``TritonEP``).

    Args: as ``TritonEP``: the group, this rank, world_size W, num_experts E, hidden H, max_tokens_per_rank, topk K,
    expert_alignment A, max_recv_tokens, device, dtype (bfloat16), ``dispatch_wire`` / ``combine_wire``
    (``"bf16"`` | ``"fp8"`` | ``"mxfp4"``, see the module docstring).

    The :class:`DispatchHandle` it returns has ``meta = wts = ntok = None`` and ``extras``: ``send_splits`` /
    ``recv_splits`` (packets per peer, host lists), ``send_tok`` int64 ``[Ns]`` (token of each sent packet, ordered by
    (destination rank, token)), ``send_here`` bool ``[Ns, K]`` (route k of that token lives on that destination),
    ``recv_rows`` int64 ``[Nr, K]`` (destination row of each received route, -1 elsewhere) and ``recv_w`` float32
    ``[Nr, K]`` (its weight, 0 elsewhere); after ``keep_quantized=True`` also ``x_scales``.

    Raises:
        WireError: an unknown wire name or a hidden size the wire cannot take (:func:`tritonep.wire.check_wire`).
    """

    name = "nccl"

    def __init__(self, group, rank, world_size, num_experts, hidden, max_tokens_per_rank, topk, expert_alignment,
                 max_recv_tokens, device, dtype=torch.bfloat16, dispatch_wire="bf16", combine_wire="bf16"):
        check_wire(dispatch_wire, hidden, "dispatch_wire")
        check_wire(combine_wire, hidden, "combine_wire")
        self.dispatch_wire, self.combine_wire = dispatch_wire, combine_wire
        self.group = group
        self.rank, self.W = rank, world_size
        self.E, self.H, self.Tm, self.K = num_experts, hidden, max_tokens_per_rank, topk
        self.L = num_experts // world_size
        self.A = expert_alignment
        self.max_recv = max_recv_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        self._eo: torch.Tensor | None = None
        self.closed = False

    # ---------------------------------------------------------------------------------------------- helpers
    def expert_out_buffer(self) -> torch.Tensor:
        """Persistent ``[max_recv_tokens, H]`` tensor for the expert output (allocated on first use)."""
        if self._eo is None:
            self._eo = torch.zeros(self.max_recv, self.H, dtype=self.dtype, device=self.device)
        return self._eo

    def check(self, what="EPBuffer"):
        """Nothing is recorded on the device by this backend: errors are raised where they happen."""

    def close(self):
        self._eo = None
        self.closed = True

    def _check_usable(self):
        if self.closed:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is closed")

    def _a2a(self, send: torch.Tensor, in_splits: list, out_splits: list) -> torch.Tensor:
        """``all_to_all_single`` of a ``[N, B]`` uint8 tensor along rows with uneven splits."""
        recv = torch.empty(sum(out_splits), send.shape[1], dtype=send.dtype, device=self.device)
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=self.group)
        return recv

    # ---------------------------------------------------------------------------------------------- dispatch
    def dispatch_fwd(self, x, topk_idx, topk_weights, sync: bool, keep_quantized: bool = False):
        """See :meth:`tritonep.EPBuffer.dispatch` (here ``x`` etc. are already validated).

        Returns ``(out [R, H], out_w [R] f32, num_tokens_per_expert [L] i32, expert_offsets [L] i32, handle)``;
        with ``keep_quantized`` and an fp8 / mxfp4 dispatch wire ``out`` is the payload (uint8 ``[R, H]`` /
        ``[R, H/2]``) and the scales are in ``handle.extras["x_scales"]`` (fp32 ``[R, H/128]`` / uint8
        ``[R, H/32]``), as on the triton backend.

        Raises:
            BackendError: ``sync=False`` or CUDA-graph capture (host split sizes are needed).
            CapacityError: some rank would receive more than ``max_recv_tokens`` rows (raised on every rank,
                nothing sent).
        """
        self._check_usable()
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not sync or capturing:
            raise BackendError("the nccl backend cannot be captured in a CUDA graph nor run without host sync "
                               f"(sync={sync}, capturing={capturing}): all_to_all needs host split sizes; "
                               "use backend='triton'")
        W, E, L, K, H = self.W, self.E, self.L, self.K, self.H
        T = x.shape[0]
        ids = topk_idx.to(torch.int64)
        dest = torch.where(ids >= 0, ids // L, -1)  # [T, K]
        present = (dest[:, :, None] == torch.arange(W, device=self.device)).any(1)  # [T, W]
        mine = torch.cat([counts_torch(ids, E), present.sum(0).to(torch.int32)])
        gathered = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(gathered, mine, group=self.group)
        mat = torch.stack(gathered).cpu()  # the one host sync
        counts, tok_per_dest = mat[:, :E], mat[:, E:]
        lay = layout_torch(counts, self.rank, self.A)
        need = lay["rows_needed"]
        if int(need.max()) > self.max_recv:
            worst = int(torch.argmax(need))
            raise CapacityError(f"dispatch: rank {worst} would receive {int(need[worst])} rows but "
                                f"max_recv_tokens={self.max_recv}; nothing was sent",
                                needed=int(need[worst]), available=self.max_recv)
        R = int(need[self.rank])
        send_splits = tok_per_dest[self.rank].tolist()
        recv_splits = tok_per_dest[:, self.rank].tolist()
        rows = route_rows_torch(topk_idx, lay["send_base"].to(self.device))  # [T, K] int32
        # packets: (destination rank, token) ascending
        pd, pt = torch.nonzero(present.t(), as_tuple=True)
        here = dest[pt] == pd[:, None]  # [Ns, K]
        p_rows = torch.where(here, rows[pt], -1).to(torch.int32)
        p_w = torch.where(here, topk_weights[pt], 0.0).to(torch.float32)
        wire = self.dispatch_wire
        xw = _encode(wire, x)  # quantized once per token, copied into every packet of the token
        send = torch.cat([_bytes(p_rows), _bytes(p_w), xw[pt]], 1)
        recv = self._a2a(send, send_splits, recv_splits)
        r_rows = _unbytes(recv[:, :4 * K], torch.int32, K).to(torch.int64)
        r_w = _unbytes(recv[:, 4 * K:8 * K], torch.float32, K)
        r_x = recv[:, 8 * K:]
        out_w = torch.zeros(R, dtype=torch.float32, device=self.device)
        pi, pk = torch.nonzero(r_rows >= 0, as_tuple=True)
        dst = r_rows[pi, pk]
        out_w[dst] = r_w[pi, pk]
        sc = None
        if keep_quantized and wire != "bf16":
            q_in, s_in = _split(wire, r_x, H)
            out = torch.zeros(R, q_in.shape[1], dtype=torch.uint8, device=self.device)
            # padding rows hold the encoding of a zero row (fp8 scale 2^-126, e8m0 0), as the twins give
            sc = torch.full((R, s_in.shape[1]), 2.0 ** -126 if wire == "fp8" else 0, dtype=s_in.dtype,
                            device=self.device)
            out[dst] = q_in[pi]
            sc[dst] = s_in[pi]
        else:
            out = torch.zeros(R, H, dtype=self.dtype, device=self.device)
            out[dst] = _decode(wire, r_x, H, self.dtype)[pi]  # one dequantization per received packet
        ntpe = lay["num_tokens_per_expert"].to(self.device)
        offs = lay["expert_offsets"].to(self.device)
        handle = DispatchHandle(topk_idx=topk_idx, topk_weights=topk_weights, rows=rows, meta=None, wts=None,
                                ntok=None, num_tokens=T, num_recv_rows=R, backend=self.name,
                                extras={"counts": counts.to(torch.int32).to(self.device),
                                        "send_splits": send_splits, "recv_splits": recv_splits,
                                        "send_tok": pt, "send_here": here, "recv_rows": r_rows, "recv_w": r_w})
        if sc is not None:
            handle.extras["x_scales"] = sc
        return out, out_w, ntpe, offs, handle

    # ---------------------------------------------------------------------------------------------- combine
    def _partials(self, eo, handle, weighted):
        """Per received packet: fp32 ``[Nr, H]`` sum over k ascending of (w *) eo[row], each product rounded first."""
        r_rows, r_w = handle.extras["recv_rows"], handle.extras["recv_w"]
        acc = torch.zeros(r_rows.shape[0], self.H, dtype=torch.float32, device=self.device)
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        for k in range(self.K):
            rk = r_rows[:, k]
            v = eo[rk.clamp(min=0)].float() if eo.shape[0] else acc
            term = v * r_w[:, k:k + 1] if weighted else v
            acc = acc + torch.where((rk >= 0)[:, None], term, zero)
        return acc

    def _combine(self, eo, handle, weighted, gw=None, wire="bf16"):
        """Partials (+ per-route scalars ``gw[row]``) back to the sources; returns ``(y [T, H], gtw [T, K] | None)``.

        ``wire``: "bf16" moves the partial rounded to eo's dtype; "fp8" / "mxfp4" quantize the fp32 partial.
        """
        self._check_usable()
        ex = handle.extras
        K, H = self.K, self.H
        part = self._partials(eo, handle, weighted)
        payload = [_encode(wire, part.to(eo.dtype) if wire == "bf16" else part)]
        if gw is not None:
            rr = ex["recv_rows"]
            g = torch.where(rr >= 0, gw[rr.clamp(min=0)] if gw.shape[0] else torch.zeros_like(ex["recv_w"]), 0.0)
            payload.append(_bytes(g.to(torch.float32)))
        back = self._a2a(torch.cat(payload, 1), ex["recv_splits"], ex["send_splits"])
        if wire == "bf16":  # partials in eo's dtype, widened to fp32
            nb, pp = H * eo.element_size(), _decode(wire, back, H, eo.dtype).float()
        else:  # dequantized straight to fp32
            nb, pp = _row_bytes(wire, H), _decode(wire, back, H, torch.float32)
        T = handle.num_tokens
        y = torch.zeros(T, H, dtype=torch.float32, device=self.device)
        pt = ex["send_tok"]
        start = 0
        for n in ex["send_splits"]:  # ranks ascending; one packet per token per rank
            if n:
                idx = pt[start:start + n]
                y[idx] = y[idx] + pp[start:start + n]
            start += n
        gtw = None
        if gw is not None:
            g = _unbytes(back[:, nb:], torch.float32, K)
            gtw = torch.zeros(T, K, dtype=torch.float32, device=self.device)
            pi, pk = torch.nonzero(ex["send_here"], as_tuple=True)
            gtw[pt[pi], pk] = g[pi, pk]
        return y.to(eo.dtype), gtw

    def combine_fwd(self, expert_out, handle, kind=None):
        """``y [T, H]`` over the combine wire (``kind`` is ignored: there is one combine on this backend)."""
        y, _ = self._combine(expert_out, handle, weighted=True, wire=self.combine_wire)
        return y

    # ---------------------------------------------------------------------------------------------- backward
    def dispatch_bwd(self, grad_recv_x, grad_recv_w, handle):
        """grad_x[t] = sum_k grad_recv_x[row(t,k)]; grad_topk_weights[t,k] = grad_recv_w[row(t,k)] (bf16 wire)."""
        return self._combine(grad_recv_x.contiguous(), handle, weighted=False,
                             gw=grad_recv_w.contiguous() if grad_recv_w is not None else None)

    def combine_bwd(self, grad_y, expert_out, handle):
        """grad_expert_out[row] = bf16(w * grad_y[t]); grad_recv_w[row] = <grad_y[t], expert_out[row]> (fp32).

        grad_y always moves as bf16 (whatever the wires), as on the triton backend.
        """
        self._check_usable()
        ex = handle.extras
        pt = ex["send_tok"]
        g_in = _bytes(grad_y.contiguous()[pt])
        recv = self._a2a(g_in, ex["send_splits"], ex["recv_splits"])
        gy = _unbytes(recv, grad_y.dtype, self.H).float()
        R = expert_out.shape[0]
        g_eo = torch.zeros(R, self.H, dtype=self.dtype, device=self.device)
        g_w = torch.zeros(R, dtype=torch.float32, device=self.device)
        rr, rw = ex["recv_rows"], ex["recv_w"]
        pi, pk = torch.nonzero(rr >= 0, as_tuple=True)
        dst = rr[pi, pk]
        g = gy[pi]
        g_eo[dst] = (g * rw[pi, pk][:, None]).to(self.dtype)
        g_w[dst] = (g * expert_out[dst].float()).sum(-1)
        return g_eo, g_w
