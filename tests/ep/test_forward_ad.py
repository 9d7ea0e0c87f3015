"""Forward-mode AD (``torch.autograd.forward_ad`` dual tensors) through EPBuffer, the custom ops and the MoE layer.

Dispatch is linear in ``(x, topk_weights)`` and combine bilinear in ``(expert_out, weights)``, so EPBuffer carries
tangents exactly: the tangent of a dispatch is the dispatch of the tangents, that of a combine the dispatch backward
of ``w * d_expert_out + d_w * expert_out`` per row (``tritonep.ep.autograd``: ``DispatchFn.jvp`` / ``CombineFn.jvp``,
one more collective each). Checked against ``torch.func.jvp`` of the pure-torch reference (dispatch_reference ->
experts -> combine_reference, fp32) on both backends, synced and sync-free; the backward halves are linear too, so
the tangent of ``dispatch_backward`` / ``combine_backward`` is the same call on the tangent (bit for bit where the
call is the same kernel). The custom ops (whose outputs are plain tensors) and the MoE layer (one opaque op) refuse
a dual input with InputError on every rank, taking part as refused; the buffer stays usable. Before, every path
returned the primal with no tangent: a directional derivative of zero, silently.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import InputError, PeerInputError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

H, TM, K = 32, 8, 2


def _inputs(rank, W):
    """This rank's ``(x, topk_idx, topk_weights)`` and tangents ``(vx bf16, vw fp32)``; 5 tokens, E = 2W."""
    x, idx, w = make_rank_inputs(rank, 5, H, 2 * W, K, seed=1, mask_frac=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    return x, idx, w, torch.randn(x.shape, generator=g).bfloat16(), torch.randn(w.shape, generator=g)


def _expert(rows):
    """Every expert: ``bf16(0.5 * row + 1)`` (torch ops: a dual row gives a dual output)."""
    return (rows.float() * 0.5 + 1).to(torch.bfloat16)


def _buffer_world(group, backend, sync_free):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    buf = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend)
    x, idx, w, vx, vw = _inputs(rank, W)
    with fwAD.dual_level():
        d = buf.dispatch(fwAD.make_dual(x, vx), idx, fwAD.make_dual(w, vw), sync_free=sync_free)
        y = buf.combine(_expert(d.x), d.handle)
        y_p, y_t = (t.clone() for t in fwAD.unpack_dual(y))
        # the backward halves, outside autograd, with a dual gradient (forward over reverse): the same call on the
        # tangent (a plain dispatch: its weights carry no tangent of their own)
        d = buf.dispatch(x, idx, w, sync_free=sync_free)
        g, vg = torch.randn(5, H).bfloat16(), torch.randn(5, H).bfloat16()
        eo = _expert(d.x)
        geo, gw = buf.combine_backward(fwAD.make_dual(g, vg), eo, d.handle)
        want_geo, want_gw = buf.combine_backward(vg, eo, d.handle)
        bwd = dict(geo=torch.equal(fwAD.unpack_dual(geo).tangent, want_geo),
                   gw=torch.allclose(fwAD.unpack_dual(gw).tangent, want_gw, rtol=2 ** -7, atol=2 ** -7))
        rows = d.x
        gx, _ = buf.dispatch_backward(fwAD.make_dual(rows, _expert(rows)), None, d.handle)
        want_gx, _ = buf.dispatch_backward(_expert(rows), None, d.handle)
        bwd["gx"] = torch.equal(fwAD.unpack_dual(gx).tangent, want_gx)
    buf.check()
    buf.close()
    return (x, idx, w, vx, vw), y_p, y_t, bwd


def _reference(ins, W):
    """Every rank's ``(y, dy)`` of dispatch -> experts (fp32) -> combine: the pure-torch reference and
    ``torch.func.jvp`` of it w.r.t. every rank's ``x`` and ``topk_weights``."""
    from tritonep.reference import combine_reference, dispatch_reference

    idxs = [i[1] for i in ins]

    def f(xs, ws):
        d = dispatch_reference(list(xs), idxs, list(ws), 2 * W, W)
        return tuple(combine_reference([0.5 * dd.x + 1 for dd in d], d, idxs, list(ws), [5] * W))

    primals = (tuple(i[0].float() for i in ins), tuple(i[2] for i in ins))
    tangents = (tuple(i[3].float() for i in ins), tuple(i[4] for i in ins))
    return torch.func.jvp(f, primals, tangents)


def _close(got, ref):
    """bf16 sums against fp32: within 2**-6 of the reference's norm."""
    return float((got.float() - ref).norm()) <= 2 ** -6 * max(float(ref.norm()), 1.0)


@pytest.mark.parametrize("W,backend,sync_free", [(2, "triton", False), (2, "triton", True), (2, "nccl", False),
                                                 (2, "nccl", True), (3, "triton", True)])
def test_buffer_carries_forward_mode_tangents_exactly(W, backend, sync_free):
    res = run_cpu_world(W, _buffer_world, backend, sync_free, timeout_s=240)
    ys, dys = _reference([r[0] for r in res], W)
    for r, (_, y_p, y_t, bwd) in enumerate(res):
        assert y_t is not None, r  # never silently dropped
        assert _close(y_p, ys[r]) and _close(y_t, dys[r]), (r, (y_t.float() - dys[r]).abs().max())
        assert bwd == dict(geo=True, gw=True, gx=True), (r, bwd)


def _refusal_world(group, backend, path):
    from tritonep.ep import ops

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    x, idx, w, vx, _ = _inputs(rank, W)
    if path == "layer":
        geo = tep.MoEGeometry(hidden=H, intermediate=16, num_experts=2 * W, topk=K, max_tokens_per_rank=TM)
        mod = tep.MoELayer(tep.MoERecipe(), geo, group, seed=1, backend=backend)
        buf = mod.buffer
    else:
        mod = buf = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend)
    dual_here = rank == 0 or path != "ops_one_rank"  # one rank's dual: its peers raise PeerInputError
    try:
        with fwAD.dual_level():
            xd = fwAD.make_dual(x, vx) if dual_here else x
            if path == "layer":
                mod(xd, idx, w)
            else:
                d = ops.dispatch(ops.buffer_id(buf), xd, idx, w)
                ops.combine(d.x, d)
        got = ("no error",)
    except PeerInputError as e:
        got = ("PeerInputError", sorted(e.bad_ranks))
    except InputError as e:
        got = ("InputError", "forward-mode" in str(e))
    # the buffer stays usable: a plain call after the refusal
    d = buf.dispatch(x, idx, w)
    y = buf.combine(_expert(d.x), d.handle)
    buf.check()
    mod.close()
    return got, bool(torch.isfinite(y).all())


@pytest.mark.parametrize("backend,path", [("triton", "ops"), ("nccl", "ops"), ("triton", "ops_one_rank"),
                                          ("triton", "layer"), ("nccl", "layer")])
def test_ops_and_layer_refuse_dual_inputs_on_every_rank(backend, path):
    res = run_cpu_world(2, _refusal_world, backend, path, timeout_s=240)
    for r, (got, ok) in enumerate(res):
        if path == "ops_one_rank" and r == 1:
            assert got == ("PeerInputError", [0]), got
        else:
            assert got == ("InputError", True), (r, got)
        assert ok, r
