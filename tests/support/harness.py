"""The one dispatch -> expert -> combine [-> backward] harness of the tests, the GPU checks and the soaks.

A rank runs calls on a buffer (:func:`run_call`, :func:`run_grad_call`, or the whole rank body :func:`calls_world`)
and returns a *record* per call: host copies of what the call gave. The host then rebuilds every rank's inputs and
compares each record with :func:`expected`, the outputs :mod:`tritonep.reference` says the call must give
(:func:`check_calls`, :func:`check_grads`, or :func:`diff` for a test that wants the list of differences).

Case dicts (the tests' shorthand): ``E`` num_experts, ``H`` hidden, ``Tmax`` max_tokens_per_rank, ``K`` topk;
optional ``A`` expert_alignment (1), ``backend`` ("auto"), ``dwire`` / ``cwire`` dispatch / combine wire ("bf16"),
``max_recv`` max_recv_tokens (None), ``timeout_s`` (None); and for :func:`calls_world` ``kind`` the combine kind
(None: the buffer's), ``repeat`` (combine the first call twice), ``out_buffer`` (True) and ``fn`` (:func:`expert`)
as in :func:`run_call`.

Record fields (CPU tensors): ``x`` received rows ``[R, H]``, ``ntpe`` num_tokens_per_expert ``[L]``, ``offs``
expert_offsets ``[L]``, ``w`` received weights ``[R]``, ``counts`` handle.counts ``[W, E]``, ``eo`` the expert output
``[R, H]`` bf16, ``y`` the combine ``[T, H]`` bf16; :func:`run_grad_call` adds ``g`` (the bf16 grad of y), ``geo``
(grad of eo), ``gx``, ``gw`` and the inputs ``xin`` / ``idx`` / ``win``.

Tolerances (docs/testing.md): rows, counts, offsets, weights and y are bit-exact (``torch.equal``; y against
:func:`tritonep.reference.combine_reference_partial`, the kernels' summation order, rounded to bf16); with
``fp32=True`` y is also within 2 bf16 ulps of the plain fp32 reference (``|err| <= 2**-7 * max(1, |y|)``). Gradients
(:func:`check_grads`): grad of the expert output within ``rtol 2**-7``, grad x within ``2**-6``, grad of the weights
within ``1e-3`` (fp32 dot products in the kernels' tile order).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from tritonep.bench.cases import make_rank_inputs

__all__ = ["BF16", "FIELDS", "expert", "make_calls", "call_inputs", "open_buffer", "record", "run_call",
           "calls_world", "run_grad_call", "set_env", "expected", "diff", "check_calls", "check_grads",
           "close_fp32", "script_world", "check_script"]

BF16 = torch.bfloat16
FIELDS = ("ntpe", "offs", "x", "w", "counts", "y")
"""The record fields :func:`diff` compares by default (those of them the record has)."""


def expert(x: torch.Tensor) -> torch.Tensor:
    """The harness's expert: ``bf16(0.5 * x + 1)`` row-wise (``[R, H]`` -> ``[R, H]`` bf16); padding rows (zeros)
    become nonzero, so a combine that read them would show."""
    return (x.float() * 0.5 + 1.0).to(BF16)


def make_calls(world_size: int, cfg: Mapping, tokens: Sequence[int], seeds: Sequence[int], mask_frac: float = 0.1):
    """``calls[rank][i] = (x, topk_idx, topk_weights)`` of call i (seed ``seeds[i]``, ``tokens[rank]`` tokens), from
    :func:`tritonep.bench.cases.make_rank_inputs` with the case's H, E, K."""
    return [[make_rank_inputs(r, tokens[r], cfg["H"], cfg["E"], cfg["K"], seed=s, mask_frac=mask_frac) for s in seeds]
            for r in range(world_size)]


def call_inputs(calls, i: int) -> list:
    """Every rank's ``(x, topk_idx, topk_weights)`` of call ``i`` of ``calls[rank][i]``."""
    return [c[i] for c in calls]


def open_buffer(group, cfg: Mapping, **kwargs):
    """``EPBuffer(group, E, H, Tmax, K, ...)`` of the case dict (keyword arguments override)."""
    import tritonep as tep

    kw = dict(expert_alignment=cfg.get("A", 1), backend=cfg.get("backend", "auto"),
              dispatch_wire=cfg.get("dwire", "bf16"), combine_wire=cfg.get("cwire", "bf16"),
              max_recv_tokens=cfg.get("max_recv"), timeout_s=cfg.get("timeout_s"))
    kw.update(kwargs)
    return tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], **kw)


def _host(t):
    """A host copy (on the CPU an output can be a view of the symmetric heap, which ``close`` frees)."""
    return None if t is None else t.detach().to("cpu", copy=True)


def record(d, eo: torch.Tensor, y: torch.Tensor) -> dict:
    """The record of one call: host copies of the dispatch result ``d``, the expert output and the combine."""
    return dict(x=_host(d.x), ntpe=_host(d.num_tokens_per_expert), offs=_host(d.expert_offsets), w=_host(d.weights),
                counts=_host(d.handle.counts), eo=_host(eo), y=_host(y))


def run_call(buf, x, idx, w, *, kind: str | None = None, fn: Callable = expert, out_buffer: bool = True,
             repeat: bool = False) -> dict:
    """dispatch -> ``fn`` -> combine of one call on ``buf`` (inputs moved to the buffer's device); its record.

    ``out_buffer``: the expert output goes into ``buf.expert_out_buffer`` (combine reads it in place) or is a plain
    tensor. ``repeat``: combine twice; the record's ``y2`` is the second (bitwise reproducibility).
    """
    dev = buf.device
    d = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
    if out_buffer:
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_(fn(d.x))
    else:
        eo = fn(d.x)
    y = buf.combine(eo, d.handle, kind=kind)
    rec = record(d, eo, y)
    if repeat:
        rec["y2"] = _host(buf.combine(eo, d.handle, kind=kind))
    return rec


def calls_world(group, cfg: Mapping, calls) -> list:
    """Rank body: one buffer of the case, :func:`run_call` on each of ``calls[rank]`` with the case's ``kind``,
    ``out_buffer`` and ``fn`` (the first call combined twice when ``cfg["repeat"]``); the records."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    buf = open_buffer(group, cfg)
    try:
        opts = dict(kind=cfg.get("kind"), fn=cfg.get("fn", expert), out_buffer=cfg.get("out_buffer", True))
        return [run_call(buf, *c, **opts, repeat=bool(cfg.get("repeat")) and i == 0) for i, c in enumerate(calls[rank])]
    finally:
        buf.close()


def run_grad_call(buf, x, idx, w, *, grad_seed: int, scale: float = 0.5, bias: float = 0.0,
                  kind: str | None = None) -> dict:
    """dispatch -> ``eo = bf16(scale * x + bias)`` -> combine -> backward of ``sum(y * g)`` with
    ``g = bf16(randn(seed grad_seed))``; the record with ``g``, ``geo`` (grad of eo), ``gx``, ``gw`` and the inputs
    (``xin``, ``idx``, ``win``). A call with no received rows has ``geo`` zeros ``[0, H]`` (autograd gives none)."""
    dev = buf.device
    xr = x.detach().to(dev).clone().requires_grad_(True)
    wr = w.detach().to(dev).clone().requires_grad_(True)
    d = buf.dispatch(xr, idx.to(dev), wr)
    eo = (d.x.float() * scale + bias).to(BF16)
    eo.retain_grad()
    y = buf.combine(eo, d.handle, kind=kind)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(BF16).to(dev)
    (y.float() * g.float()).sum().backward()
    geo = eo.grad if eo.grad is not None or eo.shape[0] else torch.zeros(eo.shape, dtype=BF16)
    rec = record(d, eo, y)
    rec.update(g=_host(g), geo=_host(geo), gx=_host(xr.grad), gw=_host(wr.grad), xin=_host(x), idx=_host(idx),
               win=_host(w))
    return rec


def set_env(**values) -> None:
    """Set (or, for None, remove) environment variables in this rank process (a forked rank's own copy)."""
    import os

    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def expected(inputs, num_experts: int, expert_alignment: int = 1, *, eos=None, fn: Callable = expert,
             rows: Callable | None = None, fp32: bool = False) -> list[dict]:
    """What every rank's record of one call must hold, from :mod:`tritonep.reference`.

    Args:
        inputs: per rank ``(x, topk_idx, topk_weights)``.
        eos: per rank the expert output the ranks used (the records' ``eo``); default ``fn`` of the reference rows.
        rows: maps the reference rows to what the wire delivers (e.g. the fp8 twin's round trip); default exact.
        fp32: also give ``y_fp32``, the plain fp32 combine reference (for :func:`close_fp32`).

    Returns:
        per rank a dict of ``ntpe, offs, x, w, counts, y`` (and ``y_fp32``), plus ``ref``, the
        :class:`tritonep.reference.RefDispatch`.
    """
    from tritonep.reference import combine_reference, combine_reference_partial, dispatch_reference

    xs, idxs, ws = ([a[j] for a in inputs] for j in range(3))
    W = len(inputs)
    ref = dispatch_reference(xs, idxs, ws, num_experts, W, expert_alignment=expert_alignment)
    eos = [fn(r.x) for r in ref] if eos is None else list(eos)
    ts = [len(x) for x in xs]
    yp = combine_reference_partial(eos, ref, idxs, ws, ts)
    yf = combine_reference(eos, ref, idxs, ws, ts) if fp32 else [None] * W
    return [dict(ntpe=ref[r].num_tokens_per_expert, offs=ref[r].expert_offsets,
                 x=ref[r].x if rows is None else rows(ref[r].x), w=ref[r].weights, counts=ref[r].counts,
                 y=yp[r].to(BF16), y_fp32=yf[r], ref=ref[r]) for r in range(W)]


def diff(got: Mapping, want: Mapping, fields: Sequence[str] | None = None, equal: Callable = torch.equal,
         padded: bool = False) -> list:
    """The fields of a record that differ from :func:`expected` (shape, dtype or bits). ``fields``: those to compare
    (default: the :data:`FIELDS` the record has). ``padded``: the call read nothing on the host (sync checks off,
    sync-free), so it returned ``max_recv_tokens`` rows: rows past ``expert_offsets[-1]`` are not compared, except
    that their weights must be 0."""
    fields = [f for f in FIELDS if f in got] if fields is None else fields
    bad = []
    for f in fields:
        g, w = got[f].cpu(), want[f]
        if padded and f in ("x", "w") and g.shape[0] >= w.shape[0]:
            if f == "w" and bool(g[w.shape[0]:].any()):
                bad.append("w past expert_offsets[-1]")
            g = g[:w.shape[0]]
        if g.shape != w.shape or not equal(g, w):
            bad.append(f)
    return bad


def close_fp32(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """``y`` (bf16) within 2 bf16 ulps of the fp32 reference: ``|y - ref| <= 2**-7 * max(1, |ref|)``."""
    return bool(((y.float() - ref).abs() <= 2 ** -7 * ref.abs().clamp_min(1.0)).all())


def check_calls(cfg: Mapping, calls, res, *, fields: Sequence[str] | None = None, rows: Callable | None = None,
                fp32: bool = False, equal: Callable = torch.equal, padded: bool = False) -> None:
    """Every rank's record of every call (``res[rank][i]``, inputs ``calls[rank][i]``) against :func:`expected`,
    with the expert output each record used; ``y2`` (when recorded) bit-equal to ``y``; ``fp32``: y also within
    :func:`close_fp32` of the fp32 reference; ``padded``: as in :func:`diff`.

    Raises:
        AssertionError: naming the call, the rank and the fields that differ.
    """
    W = len(calls)
    for i in range(len(calls[0])):
        got = [res[r][i] for r in range(W)]
        eos = [g["eo"][:int(g["offs"][-1])] if padded else g["eo"] for g in got]
        want = expected(call_inputs(calls, i), cfg["E"], cfg.get("A", 1), eos=eos, rows=rows, fp32=fp32)
        for r in range(W):
            bad = diff(got[r], want[r], fields, equal, padded)
            assert not bad, f"call {i} rank {r} (T={[len(c[i][0]) for c in calls]}): {bad} differ from the reference"
            if fp32:
                assert close_fp32(got[r]["y"], want[r]["y_fp32"]), f"call {i} rank {r}: y vs the fp32 reference"
            if got[r].get("y2") is not None:
                assert torch.equal(got[r]["y2"], got[r]["y"]), f"call {i} rank {r}: a second combine differs"


def check_grads(num_experts: int, res, *, scale: float = 0.5, expert_alignment: int = 1, where: str = "") -> None:
    """The gradients of every rank's :func:`run_grad_call` record of one call against :mod:`tritonep.reference`:
    grad eo vs :func:`combine_backward_reference` (rtol ``2**-7``), grad x vs :func:`dispatch_backward_reference` of
    ``scale * grad eo`` (``2**-6``), grad weights (``1e-3``).

    Raises:
        AssertionError: naming the rank and the gradient that differs.
    """
    from tritonep.reference import combine_backward_reference, dispatch_backward_reference, dispatch_reference

    W = len(res)
    xs, idxs, ws = ([r[k] for r in res] for k in ("xin", "idx", "win"))
    ref = dispatch_reference(xs, idxs, ws, num_experts, W, expert_alignment=expert_alignment)
    g_eo, g_w = combine_backward_reference([r["g"] for r in res], [r["eo"] for r in res], ref, idxs, ws)
    gx = dispatch_backward_reference([scale * r["geo"].float() for r in res], ref, idxs, [len(x) for x in xs])
    for r, o in enumerate(res):
        assert None not in (o["gx"], o["gw"], o["geo"]), f"{where} rank {r}: no gradient"
        assert o["gx"].shape == xs[r].shape and o["gw"].shape == idxs[r].shape, f"{where} rank {r}: grad shapes"
        assert torch.allclose(o["geo"].float(), g_eo[r].float(), rtol=2 ** -7, atol=1e-6), f"{where} rank {r}: geo"
        assert torch.allclose(o["gx"].float(), gx[r].float(), rtol=2 ** -6, atol=2 ** -6), f"{where} rank {r}: gx"
        assert torch.allclose(o["gw"], g_w[r].float(), rtol=1e-3, atol=1e-3), f"{where} rank {r}: gw"


def _script_inputs(rank: int, cfg: Mapping, step) -> tuple:
    what, seed, Ts = step[:3]
    x, idx, w = make_rank_inputs(rank, Ts[rank], cfg["H"], cfg["E"], cfg["K"], seed=seed, mask_frac=0.15)
    if what == "bad" and rank == step[3]:
        if Ts[rank] > 0:
            idx[-1, 0] = cfg["E"]  # found on the device, in the counts exchange
        else:  # no token to hold a bad id: a topk_idx one column too wide, refused at the front door
            idx = torch.zeros(0, cfg["K"] + 1, dtype=idx.dtype)
    if what == "cap":
        idx = torch.zeros_like(idx)  # every route to expert 0: rank 0 receives more than max_recv rows
    return x, idx, w


def script_world(group, cfg: Mapping, steps) -> list:
    """Rank body: ``steps`` on one buffer of the case (strict sync checks; ``cfg["geometry"]``, a TRITONEP_GEOMETRY
    string, for this buffer only). A step is ``("ok", seed, Ts, kind)``: :func:`run_call` (combine ``kind`` None /
    push / pull, the expert output a plain tensor) or, for kind ``"grad"``, :func:`run_grad_call` with the same
    expert (grad seed ``seed + rank``); ``("bad", seed, Ts, bad_rank)``: ``bad_rank``'s last token picks expert E
    (found on the device), or with no token its ``topk_idx`` is ``[0, K + 1]`` (refused at the front door);
    ``("cap", seed, Ts)``: every route to expert 0 (over ``max_recv``). ``Ts``: tokens per rank; inputs from
    :func:`tritonep.bench.cases.make_rank_inputs` (mask 0.15).

    Returns:
        per step the record or, for a refused step, ``(error class name, message)`` (``("no error", "")`` if the
        call returned), then the buffer's geometry ``(bt, cbt, decode, fused_combine, grid_partial)``.
    """
    import torch.distributed as dist

    from tritonep.errors import CapacityError, InputError, PeerInputError

    rank = dist.get_rank(group)
    set_env(TRITONEP_SYNC_CHECKS="1", TRITONEP_GEOMETRY=cfg.get("geometry"))
    buf = open_buffer(group, cfg)
    set_env(TRITONEP_GEOMETRY=None)
    out = []
    for step in steps:
        x, idx, w = _script_inputs(rank, cfg, step)
        if step[0] != "ok":
            try:
                buf.dispatch(x, idx, w)
                out.append(("no error", ""))
            except (InputError, PeerInputError, CapacityError) as e:
                out.append((type(e).__name__, str(e)))
        elif step[3] == "grad":
            out.append(run_grad_call(buf, x, idx, w, grad_seed=step[1] + rank, bias=1.0))
        else:
            out.append(run_call(buf, x, idx, w, kind=step[3], out_buffer=False))
    geo = buf.tiles
    buf.close()
    return out + [(geo.bt, geo.cbt, geo.decode, geo.fused_combine, geo.grid_partial)]


def check_script(cfg: Mapping, steps, res, geo: tuple | None = None) -> None:
    """Every rank's :func:`script_world` result: refused steps refused on every rank (the bad rank's InputError
    naming its value, whatever its T: the id E, or with no token the ``[0, K + 1]`` shape; its peers'
    PeerInputError naming it; CapacityError everywhere), good steps against :func:`expected`, grad steps also
    :func:`check_grads`; ``geo``: the buffer's expected geometry tuple.

    Raises:
        AssertionError: naming the step, the rank and what differs.
    """
    W = len(res)
    if geo is not None:
        assert all(res[r][-1] == geo for r in range(W)), [res[r][-1] for r in range(W)]
    for i, step in enumerate(steps):
        got = [res[r][i] for r in range(W)]
        what, _, Ts = step[:3]
        if what == "bad":
            bad = step[3]
            assert [g[0] for g in got] == ["InputError" if r == bad else "PeerInputError" for r in range(W)], (i, got)
            value = f"= {cfg['E']} is outside" if Ts[bad] > 0 else f"got (0, {cfg['K'] + 1})"
            assert value in got[bad][1], (i, bad, got[bad][1])
            assert all(f"rank(s) [{bad}]" in got[r][1] for r in range(W) if r != bad), (i, got)
            continue
        if what == "cap":
            assert [g[0] for g in got] == ["CapacityError"] * W, (i, got)
            continue
        want = expected([_script_inputs(r, cfg, step) for r in range(W)], cfg["E"], cfg.get("A", 1),
                        eos=[g["eo"] for g in got])
        for r in range(W):
            assert diff(got[r], want[r]) == [], (i, r, step, diff(got[r], want[r]))
        if step[3] == "grad":
            check_grads(cfg["E"], got, expert_alignment=cfg.get("A", 1), where=f"step {i}")
