"""World-1 references that move the same bytes as a dispatch / combine, each one torch op: a second floor.

The byte floor of :func:`tritonep.bench.ep.floor_us` prices a row's HBM bytes at the rate of a 256 MB linear
``copy_`` (half reads, half writes). A dispatch at world 1 is mostly writes (DeepSeek-V3, 4096 tokens: it reads the
``[T, H]`` tokens once and writes ``K`` rows per token), and its reads repeat each token row ``K`` times. This module
times torch's own kernels doing exactly that traffic on the same GPU, in the same run:

* dispatch (bf16, or rows kept quantized): ``torch.index_select`` of the token rows (payload, then scales) into one
  row per route in expert order -- the rows a world-1 dispatch writes, bit for bit;
* the dispatch's writes alone: ``fill_`` of its output rows (payload and scales when kept) with one byte value --
  the HBM write rate on this GPU (pure writes, sequential), a lower bound on any dispatch of these rows (it also
  reads the tokens);
* combine (bf16): ``torch.sum`` over each token's ``K`` expert rows, laid out token by token beforehand (contiguous
  reads, fp32 accumulation, one bf16 rounding; unweighted) -- the same bytes as the combine reads and writes, in an
  easier order.

Every point checks its output (the gather against indexing on the host, bit for bit; the combine against an fp32
reference within bf16 rounding). Rows carry ``op = "torch.same_bytes.[writes.]<call>.<wire>[.kept]"`` and the byte
counts of the tritonep row they price; :func:`same_bytes_lines` prints each tritonep world-1 graph row against its reference.
"""

from __future__ import annotations

import torch

from .check import compare_close, compare_exact, mark_checked

__all__ = ["route_order", "same_bytes_points", "same_bytes_lines"]


def route_order(topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes of a world-1 dispatch in the order its rows are written: by expert, then by token.

    Args:
        topk_idx: ``[T, K]`` int expert ids (-1: no route).
    Returns:
        ``(token, slot)``: int64 ``[R]`` each, the token and top-k slot of every received row (R valid routes).
    """
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    valid = torch.nonzero(flat >= 0).flatten()
    order = torch.argsort(flat[valid] * (T * K) + valid, stable=True)
    pos = valid[order]
    return pos // K, pos % K


def same_bytes_points(row, x: torch.Tensor, topk_idx: torch.Tensor, wires, time_fn, rank: int = 0) -> list:
    """Time and check the same-bytes references of one world-1 profile (see the module docstring).

    Args:
        row: ``row(name, us, mode, extra) -> dict``, the benchmark's row maker (:func:`tritonep.bench.ep.bench_ep`'s).
        x: ``[T, H]`` bf16 tokens. topk_idx: ``[T, K]`` ids.
        wires: the wire names timed for tritonep in the same run (quantized ones get a kept-rows reference).
        time_fn: ``time_fn(fn) -> (us, mode)`` (graph replay on a GPU).
        rank: for the FAILED lines.
    Returns:
        the rows made (also appended by ``row``), each marked checked or failed.
    """
    from ..wire.formats import get_wire

    T, H = x.shape
    K = topk_idx.shape[1]
    tok, slot = route_order(topk_idx)
    R = tok.numel()
    made = []
    for wire in wires:
        fmt = get_wire(wire)
        if not fmt.quantized:
            out = torch.empty(R, H, dtype=x.dtype, device=x.device)
            us, mode = time_fn(lambda: torch.index_select(x, 0, tok, out=out))
            want = x.cpu()[tok.cpu()]
            made.append(mark_checked(row(f"torch.same_bytes.dispatch.{wire}", us, mode,
                                         dict(wire=wire, moved_bytes=T * H * 2 + R * H * 2)),
                                     compare_exact(dict(x=out.cpu()), dict(x=want)), rank))
            made.append(_writes(row, f"dispatch.{wire}", (out,), time_fn, rank, dict(wire=wire, moved_bytes=R * H * 2)))
            continue
        q, s = fmt.quantize_torch(x)
        q, s = q.contiguous(), s.contiguous()
        oq = torch.empty(R, q.shape[1], dtype=q.dtype, device=x.device)
        os_ = torch.empty(R, s.shape[1], dtype=s.dtype, device=x.device)

        def gather_kept(q=q, s=s, oq=oq, os_=os_):
            torch.index_select(q, 0, tok, out=oq)
            torch.index_select(s, 0, tok, out=os_)

        us, mode = time_fn(gather_kept)
        rb = fmt.row_bytes(H)
        made.append(mark_checked(row(f"torch.same_bytes.dispatch.{wire}.kept", us, mode,
                                     dict(wire=wire, moved_bytes=T * rb + R * rb)),
                                 compare_exact(dict(q=oq.cpu(), s=os_.cpu()),
                                               dict(q=q.cpu()[tok.cpu()], s=s.cpu()[tok.cpu()])), rank))
        made.append(_writes(row, f"dispatch.{wire}.kept", (oq, os_), time_fn, rank, dict(wire=wire, moved_bytes=R * rb)))
    if R == T * K:  # every route valid: each token's K rows laid out token by token, summed
        rows = torch.randn(R, H, device=x.device).to(torch.bfloat16)
        inv = torch.empty_like(tok)
        inv[tok * K + slot] = torch.arange(R, device=x.device)
        by_token = rows.index_select(0, inv).view(T, K, H)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
        us, mode = time_fn(lambda: torch.sum(by_token, 1, out=y))
        want = by_token.float().sum(1)
        made.append(mark_checked(row("torch.same_bytes.combine.bf16", us, mode,
                                     dict(wire="bf16", moved_bytes=R * H * 2 + T * H * 2)),
                                 compare_close("y", y, want, 2 ** -7), rank))
    return made


def _writes(row, call: str, outs, time_fn, rank: int, extra: dict) -> dict:
    """The dispatch's writes alone: every tensor of ``outs`` (its output rows: payload, scales) filled with the byte
    0x5A by ``fill_`` on a uint8 view; checked: every byte holds it."""
    flat = [o.view(torch.uint8) for o in outs]

    def fill():
        for f in flat:
            f.fill_(0x5A)

    for f in flat:
        f.zero_()
    us, mode = time_fn(fill)
    got = {f"out{i}": f.cpu() for i, f in enumerate(flat)}
    want = {f"out{i}": torch.full(f.shape, 0x5A, dtype=torch.uint8) for i, f in enumerate(flat)}
    return mark_checked(row(f"torch.same_bytes.writes.{call}", us, mode, extra), compare_exact(got, want), rank)


def same_bytes_lines(rows) -> list:
    """One line per tritonep world-1 graph dispatch / combine row that has a same-bytes reference in ``rows``:
    its time over the reference's (same profile and variant)."""
    out = []
    ref = {(r["profile"], r["op"].split(".", 2)[2]): r for r in rows
           if r.get("op", "").startswith("torch.same_bytes.") and r.get("checked")}
    for r in rows:
        op = r.get("op", "")
        if r.get("world_size") != 1 or r.get("mode") != "graph" or not op.startswith("tritonep."):
            continue
        parts = op.split(".")
        key = {"dispatch": ".".join(parts[1:]), "combine": f"combine.{parts[-1]}"}.get(parts[1]) if len(parts) > 2 \
            else None
        b = ref.get((r["profile"], key))
        if b:
            out.append(f"{r['profile']} {op} [{r.get('variant') or 'table'}]: {r['us'] / b['us']:.2f}x the same "
                       f"bytes moved by torch ({r['us']:.0f} / {b['us']:.0f} us, {b['op']})")
        u = ref.get((r["profile"], f"writes.{key}")) if parts[1] == "dispatch" else None
        if u:
            out.append(f"{r['profile']} {op} [{r.get('variant') or 'table'}]: {r['us'] / u['us']:.2f}x torch's fill "
                       f"of its written bytes alone ({r['us']:.0f} / {u['us']:.0f} us, {u['op']})")
    return out
