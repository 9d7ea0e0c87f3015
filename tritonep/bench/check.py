"""Benchmark self-checks: every timed point compares one call's output with the oracle afterwards.

As the seed's EPv2 benchmark does with ``CHECK=1``: after a point is timed, the output of one of its calls (the
captured call of a CUDA graph, whose tensors every replay rewrites, or the last eager call) is compared with the
oracle: rows and counts bit for bit, combine against the fixed-order reference, the MoE layer within the stated
tolerance of :mod:`tritonep.reference_moe`. The row records ``checked: True``, or ``checked: False`` plus
``check_error``; such a point prints ``FAILED`` and the driver exits non-zero (:func:`exit_code`).

The EP oracles here are the single-destination, on-device forms of :func:`tritonep.reference.dispatch_reference`
and :func:`tritonep.reference.combine_reference_partial` (same layout, same fp32 order; tested equal to them on
CPU), built once per point from tensors already on the device: no Python loop over tokens or experts, so they take
milliseconds at the DeepSeek-V3 shape (4096 tokens x 7168 hidden).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

__all__ = ["PointChecker", "wire_roundtrip", "bench_expert", "rank_dispatch_oracle", "rank_combine_oracle", "compare_exact",
           "compare_close", "kept_decoded", "mark_checked", "failed_rows", "exit_code"]


def wire_roundtrip(wire: str, x: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` bf16 rows as the receiver decodes them after ``wire`` (bf16: unchanged; a quantized wire: its
    registered twin quantizer then its twin dequantizer to fp32, rounded to bf16), i.e. what dispatch outputs for
    these rows. Raises WireError for a wire that is not registered (:func:`tritonep.wire.formats.get_wire`)."""
    from ..wire.formats import get_wire

    fmt = get_wire(wire)
    if not fmt.quantized:
        return x
    return fmt.dequantize_torch(*fmt.quantize_torch(x), torch.float32).to(torch.bfloat16)


def _partial_roundtrip(wire: str, part: torch.Tensor) -> torch.Tensor:
    """A combine partial ``[T, H]`` fp32 as it arrives over ``wire`` (fp32 out; the wire's registered twins)."""
    from ..wire.formats import get_wire

    fmt = get_wire(wire)
    if not fmt.quantized:
        return part.to(torch.bfloat16).float()
    return fmt.dequantize_torch(*fmt.quantize_torch(part), torch.float32)


def bench_expert(rows: torch.Tensor) -> torch.Tensor:
    """The benchmarks' stand-in expert: ``bf16(x * 0.5 + 0.25)`` row by row (``[R, H]`` -> ``[R, H]`` bf16), so an
    expert output depends only on its route's token and the combine oracle needs no peer data."""
    return (rows.float() * 0.5 + 0.25).to(torch.bfloat16)


def rank_dispatch_oracle(x_all: torch.Tensor, idx_all: torch.Tensor, w_all: torch.Tensor, num_experts: int,
                         rank: int, expert_alignment: int = 1) -> dict:
    """What ``rank`` receives from dispatch (:func:`tritonep.reference.dispatch_reference` for one destination).

    Args:
        x_all: ``[W, T, H]`` every rank's tokens (equal T per rank; pad with masked tokens), any dtype, on the device.
        idx_all: ``[W, T, K]`` int32/int64 expert ids in ``[-1, E)``; w_all: ``[W, T, K]`` float32 weights.
        num_experts: E (multiple of W). rank: the destination. expert_alignment: segment length multiple (>= 1).

    Returns:
        dict ``x [R, H]`` (dtype of x_all, zero padding rows), ``num_tokens_per_expert [L]`` int32,
        ``expert_offsets [L]`` int32 (segment ends), ``weights [R]`` float32, ``src [R]`` int64 flat source token
        ``r * T + t`` (-1 on padding), on x_all's device. Rows of a segment are ordered by (source rank, token, k).
    """
    W, T, K = idx_all.shape
    L = num_experts // W
    dev = x_all.device
    flat = idx_all.reshape(-1).to(device=dev, dtype=torch.int64)
    pos = torch.nonzero((flat >= 0) & (flat // L == rank)).flatten()  # (r, t, k) ascending
    el = flat[pos] % L
    order = torch.sort(el, stable=True).indices
    pos, el = pos[order], el[order]
    n = torch.bincount(el, minlength=L)
    seg = (n + expert_alignment - 1) // expert_alignment * expert_alignment
    ends = torch.cumsum(seg, 0)
    first = torch.cumsum(n, 0) - n  # index of expert j's first route in the sorted list
    rows = (ends - seg)[el] + torch.arange(el.numel(), device=dev) - first[el]
    R = int(ends[-1]) if L else 0
    x = torch.zeros(R, x_all.shape[-1], dtype=x_all.dtype, device=dev)
    x[rows] = x_all.reshape(W * T, -1)[pos // K]
    weights = torch.zeros(R, dtype=torch.float32, device=dev)
    weights[rows] = w_all.reshape(-1).to(device=dev, dtype=torch.float32)[pos]
    src = torch.full((R,), -1, dtype=torch.int64, device=dev)
    src[rows] = pos // K
    return dict(x=x, num_tokens_per_expert=n.to(torch.int32), expert_offsets=ends.to(torch.int32),
                weights=weights, src=src)


def rank_combine_oracle(expert_rows: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        num_experts: int, world_size: int, combine_wire: str = "bf16") -> torch.Tensor:
    """This rank's combine output when every route of token ``t`` came back as ``expert_rows[t]``.

    The exact order of :func:`tritonep.reference.combine_reference_partial` (docs/protocols.md): per expert rank ``d``
    ascending, ``partial_d = 0 + sum_{k ascending, route on d} fp32(w[t,k] * row)``, rounded over ``combine_wire``
    (bf16 rounding, or the wire's registered twins), then ``y = 0 + partial_0 + ... `` in fp32; returns ``[T, H]`` bf16.

    Args:
        expert_rows: ``[T, H]`` the expert output of each token's routes (see :func:`bench_expert`).
        topk_idx / topk_weights: ``[T, K]`` this rank's routing (ids in ``[-1, E)``, weights float32).
    """
    T, K = topk_idx.shape
    L = num_experts // world_size
    rows = expert_rows.float()
    w = topk_weights.to(device=rows.device, dtype=torch.float32)
    idx = topk_idx.to(rows.device)
    zero = torch.zeros_like(rows)
    y = zero
    for d in range(world_size):
        acc = zero
        has = torch.zeros(T, 1, dtype=torch.bool, device=rows.device)
        for k in range(K):
            m = ((idx[:, k] >= 0) & (idx[:, k] // L == d))[:, None]
            acc = acc + torch.where(m, w[:, k:k + 1] * rows, zero)
            has = has | m
        y = y + torch.where(has, _partial_roundtrip(combine_wire, acc), zero)
    return y.to(torch.bfloat16)


def kept_decoded(q, wire: str):
    """A dispatch with rows kept quantized (:class:`tritonep.Dispatched` with ``x`` the payload, ``x_scales`` the
    scales) as the checks read a dispatch: its received rows decoded to bf16 (the wire's torch decoder), the counts,
    offsets and weights as they are."""
    from ..wire.formats import get_wire

    fmt = get_wire(wire)
    n = int(q.expert_offsets[-1]) if q.expert_offsets.numel() else 0
    return SimpleNamespace(x=fmt.dequantize_torch(q.x[:n], q.x_scales[:n], torch.bfloat16),
                           num_tokens_per_expert=q.num_tokens_per_expert, expert_offsets=q.expert_offsets,
                           weights=q.weights)


def compare_exact(got: dict, want: dict) -> str:
    """'' when every field of ``want`` equals ``got``'s bit for bit (same shape and dtype), else the fields that
    differ, with the first differing index of each."""
    bad = []
    for k, v in want.items():
        g = got.get(k)
        if g is None or g.shape != v.shape or g.dtype != v.dtype:
            bad.append(f"{k}: shape/dtype {None if g is None else (tuple(g.shape), g.dtype)} != "
                       f"{(tuple(v.shape), v.dtype)}")
        elif not torch.equal(g, v.to(g.device)):
            i = torch.nonzero(g.reshape(-1) != v.to(g.device).reshape(-1))
            bad.append(f"{k}: differs at flat index {int(i[0]) if i.numel() else '?'} ({i.numel()} elements)")
    return "; ".join(bad)


def compare_close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> str:
    """'' when ``max|got - want| <= rel * max|want|`` (fp32), else a message with the measured ratio."""
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    return "" if err <= rel * max(scale, 1e-30) or err == 0.0 else \
        f"{name}: max|diff| {err:.3g} > {rel:g} x max|ref| {scale:.3g}"


def mark_checked(row: dict, error: str, rank: int = 0) -> dict:
    """Record the check of one point in its row (``checked``, and ``check_error`` when it failed); prints
    ``FAILED`` with the point and the reason (every rank that sees a failure prints it). Returns the row."""
    row["checked"] = not error
    if error:
        row["check_error"] = error
        print(f"FAILED [rank {rank}] {row.get('profile', '')} {row.get('op', '')} {row.get('mode', '')} "
              f"{row.get('variant', '')}: {error}", flush=True)
    return row


def failed_rows(rows) -> list:
    """The rows whose check failed or never ran (``checked`` missing or False)."""
    return [r for r in rows if r.get("checked") is not True]


def exit_code(rows) -> int:
    """0 when every row checked itself successfully, else 1 (after printing how many points FAILED)."""
    bad = failed_rows(rows)
    if bad:
        print(f"FAILED: {len(bad)} of {len(rows)} benchmark points did not check: "
              + ", ".join(f"{r.get('profile', '')}/{r.get('op', '')}/{r.get('mode', '')}" for r in bad[:12]),
              flush=True)
    return 1 if bad else 0


class PointChecker:
    """The oracle of one benchmark shape on this rank, and the checks of its points (see the module docstring).

    Args: group (the EP group), x ``[T, H]`` bf16, idx ``[T, K]`` and w ``[T, K]`` float32: this rank's inputs
    (equal T on every rank), num_experts E. Construction all-gathers every rank's inputs (a collective: every rank
    builds one at the same point); the oracle of a wire is built on first use, on the inputs' device.
    """

    def __init__(self, group, x, idx, w, num_experts):
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        self.x_all, self.idx_all, self.w_all = (_gather(t, group, self.W) for t in (x, idx, w))
        self.idx, self.w, self.E = idx, w, num_experts
        self._oracles = {}

    def oracle(self, wire: str):
        """``(dispatch oracle dict, combine output [T, H] bf16)`` for ``wire`` (built once)."""
        if wire not in self._oracles:
            W, T, H = self.x_all.shape
            xw_all = wire_roundtrip(wire, self.x_all.reshape(W * T, H)).reshape(W, T, H)
            ref = rank_dispatch_oracle(xw_all, self.idx_all, self.w_all, self.E, self.rank)
            ref.pop("src")
            y = rank_combine_oracle(bench_expert(xw_all[self.rank]), self.idx, self.w, self.E, W, wire)
            self._oracles[wire] = (ref, y)
        return self._oracles[wire]

    def dispatch(self, row: dict, d, wire: str) -> dict:
        """Check a :class:`tritonep.Dispatched` (rows past the received count are ignored) and mark ``row``."""
        ref = self.oracle(wire)[0]
        n = ref["x"].shape[0]
        got = dict(x=d.x[:n], num_tokens_per_expert=d.num_tokens_per_expert, expert_offsets=d.expert_offsets,
                   weights=None if d.weights is None else d.weights[:n])
        return mark_checked(row, compare_exact(got, ref), self.rank)

    def combine(self, row: dict, y: torch.Tensor, wire: str) -> dict:
        """Check a combine output ``[T, H]`` bit for bit (expert outputs from :meth:`expert_out`); mark ``row``."""
        return mark_checked(row, compare_exact(dict(y=y), dict(y=self.oracle(wire)[1])), self.rank)

    @staticmethod
    def expert_out(eo: torch.Tensor, d) -> torch.Tensor:
        """Fill the received rows of an expert-output buffer with :func:`bench_expert` of ``d.x``; returns eo."""
        n = int(d.expert_offsets[-1]) if d.expert_offsets.numel() else 0
        eo[:n].copy_(bench_expert(d.x[:n]))
        return eo


def _gather(t: torch.Tensor, group, W: int) -> torch.Tensor:
    """``[W, *t.shape]``: every rank's ``t`` (equal shapes), on t's device."""
    parts = [torch.empty_like(t) for _ in range(W)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)
