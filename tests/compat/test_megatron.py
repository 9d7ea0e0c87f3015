"""Megatron-core's own DeepEP path runs on the compat Buffer in CPU worlds (megatron-core 0.16.1, scripts/setup.sh).

``tritonep.compat.deep_ep.install()`` runs before megatron imports ``deep_ep``, so ``fused_a2a.HAVE_DEEP_EP`` is True
and megatron's code is used unchanged:

* ``fused_a2a.fused_dispatch`` / ``fused_combine`` (the ``FusedDispatch`` / ``FusedCombine`` autograd functions:
  ``get_buffer`` with DeepEP's size hints, ``get_dispatch_layout``, ``dispatch`` with top-k, ``combine`` with the
  probabilities' gradient in backward, cached ``dispatch`` in backward, ``async_finish`` / ``allocate_on_comm_stream``
  events): forward rows and gradients against DeepEP's semantics (a token's rows summed over ranks; the probability
  gradient reduced over ranks);
* the flex token dispatcher (``MoEFlexTokenDispatcher``, ``moe_flex_dispatcher_backend="deepep"``) against
  megatron's alltoall dispatcher (``MoEAlltoAllTokenDispatcher``) on the same tokens, routing and experts: the layer
  output and the gradients of the tokens, the router probabilities and the expert weights.

What megatron needs from CUDA and gets here instead (patched inside the forked ranks only, nothing else):
``torch.cuda.current_device`` returns "cpu" (megatron's ``_AllToAll`` allocates its output on the current CUDA
device); ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` are no-op stand-ins (the alltoall dispatcher copies
its split sizes to the host on a side stream); ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` turns a CPU tensor
into numpy as it does a CUDA one (the alltoall dispatcher's split sizes); ``torch._dynamo.config.disable = True``
(megatron's ``jit_fuser`` is ``torch.compile``, which the flex dispatcher's ``dispatch_preprocess`` carries: no
compiler on the CPU). ``moe_permute_fusion`` is off (TransformerEngine's fused permute is CUDA-only).

CI installs megatron-core (scripts/setup.sh), so there these tests never skip; elsewhere they skip without it.
"""

import contextlib
import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

from tests.compat.deepep_reference import gather, routing
from tritonep.testing import run_cpu_world

if not os.environ.get("CI") and importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed (scripts/setup.sh installs it)", allow_module_level=True)

TOLS = (2.0 ** -7, 2.0 ** -7, 1e-6, 1e-12)
"""max|flex - alltoall| <= tol * max|alltoall| for the output and the token gradient (bf16 sums of up to K rows in
another order: one bf16 rounding), the probability gradient (float32: the reduced weights come back exact, only the
order of float32 sums may differ) and the expert weight gradients (float64 sums over the tokens in another order)."""


@pytest.fixture(scope="module")
def megatron():
    """megatron's MoE modules imported with ``deep_ep`` resolving to the compat package (sys.modules restored)."""
    import tritonep.compat.deep_ep as compat

    saved = {k: sys.modules.get(k) for k in ("deep_ep", "deep_ep.utils")}
    compat.install()
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is compat.Buffer
    yield token_dispatcher, fused_a2a
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


class _Stream:
    """No-op stand-in for a CUDA stream (see the module docstring)."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _cpu_patches(td):
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a: _Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch._dynamo.config.disable = True
    move = td.maybe_move_tensor_to_cpu

    def move_cpu(t, as_numpy=False, record_stream=False):
        return t.numpy() if torch.is_tensor(t) and as_numpy else move(t, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = move_cpu


def _fused_a2a(group, td, fa):
    """fused_dispatch -> rows scaled per rank -> fused_combine, forward and backward, against DeepEP's semantics."""
    _cpu_patches(td)
    import tritonep.compat.deep_ep as compat

    rank, W = group.rank(), group.size()
    E, K, H, T = 4 * W, 3, 64, 9 + rank  # some tokens reach one rank, some several
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen).bfloat16().requires_grad_(True)
    idx, p = routing(T, E, K, gen)
    p = p.nan_to_num(0.0).requires_grad_(True)
    recv_x, recv_idx, recv_p, tpe, handle = fa.fused_dispatch(x, idx, p, E, group, async_finish=True,
                                                              allocate_on_comm_stream=True)
    assert isinstance(fa._buffer, compat.Buffer) and tpe.dtype == torch.int64
    scale = float(rank + 2)
    y, _ = fa.fused_combine(recv_x * scale, group, handle, async_finish=True, allocate_on_comm_stream=True)
    gy = torch.randn(T, H, generator=gen)
    (y.float() * gy).sum().backward(retain_graph=True)
    gx = x.grad.clone()
    x.grad = None
    c = torch.randn(recv_p.shape, generator=gen)  # per received slot (all bits of a float32 used)
    (recv_p * c).sum().backward()
    ids = gather(group, idx)
    L = E // W
    in_rank = [torch.zeros(i.shape[0], W, dtype=torch.bool) for i in ids]  # every source's token -> rank map
    for s_, i in enumerate(ids):
        for t in range(i.shape[0]):
            for e in i[t].tolist():
                if e >= 0:
                    in_rank[s_][t, e // L] = True
    mine = in_rank[rank]
    y_ref = torch.zeros(T, H)  # DeepEP's combine: each receiving rank's bf16 row, summed in rank order in fp32
    gx_ref = torch.zeros(T, H)  # backward: the cached dispatch of gy, scaled there, combined back the same way
    for r in range(W):
        y_ref[mine[:, r]] += (x.detach()[mine[:, r]] * float(r + 2)).float()
        gx_ref[mine[:, r]] += (gy.bfloat16()[mine[:, r]] * float(r + 2)).float()
    ok = [torch.equal(y, y_ref.bfloat16()), torch.equal(gx, gx_ref.bfloat16()),
          tpe.tolist() == [int(sum((i == rank * L + j).sum() for i in ids)) for j in range(L)]]
    # the probability gradient: DeepEP's combine sums every receiving rank's [row, k] (DeepEP does not mask slots
    # whose expert lives elsewhere; megatron's gradients are zero there)
    cs = gather(group, c)
    g_ref = torch.zeros(T, K)
    for r in range(W):
        row = sum(int(in_rank[s_][:, r].sum()) for s_ in range(rank))
        for t in range(T):
            if mine[t, r]:
                g_ref[t] += cs[r][row]
                row += 1
    ok.append(torch.equal(p.grad, g_ref))
    return ok


def _dispatcher(group, kind, td, seed):
    """One MoE layer step through megatron's ``kind`` dispatcher: preprocess -> dispatch -> per-expert linear with the
    router probability -> combine, then backward; returns the output and the gradients."""
    _cpu_patches(td)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    rank, W = group.rank(), group.size()
    singles = [dist.new_group([r], backend="gloo") for r in range(W)]  # expert tensor parallel groups of one rank
    pgc = ProcessGroupCollection(ep=group, expt_tp=singles[rank], tp_ep=group)
    E, K, H, S, B = 4 * W, 3, 64, 5 + 2 * rank, 2
    L = E // W
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
                            moe_router_topk=K, moe_token_dispatcher_type=kind, moe_flex_dispatcher_backend="deepep",
                            expert_model_parallel_size=W, moe_router_dtype="fp32", bf16=True,
                            params_dtype=torch.bfloat16, moe_permute_fusion=False)
    cls = td.MoEFlexTokenDispatcher if kind == "flex" else td.MoEAlltoAllTokenDispatcher
    d = cls(L, list(range(rank * L, rank * L + L)), cfg, pg_collection=pgc)
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(S, B, H, generator=gen).bfloat16().requires_grad_(True)
    top = torch.randn(S * B, E, generator=gen).topk(K, 1)
    probs = torch.zeros(S * B, E).scatter(1, top.indices, top.values.softmax(1)).requires_grad_(True)
    w = torch.randn(L, H, H, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    w.requires_grad_(True)
    h, p = d.dispatch_preprocess(x, probs.detach() > 0, probs)
    h, p = d.token_dispatch(h, p)
    tokens, per_expert, pp = d.dispatch_postprocess(h, p)
    outs, start = [], 0
    for j, n in enumerate(per_expert.tolist()):
        seg = tokens[start:start + n].double() @ w[j] * pp[start:start + n, None].double()
        outs.append(seg.bfloat16())
        start += n
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(torch.cat(outs))))
    (y.float() * torch.randn(y.shape, generator=gen)).sum().backward()
    return y.detach(), x.grad, probs.grad, w.grad


@pytest.mark.parametrize("world,backend", [(2, "nccl"), pytest.param(2, "triton", marks=pytest.mark.slow),
                                           pytest.param(4, "nccl", marks=pytest.mark.slow)])
def test_fused_a2a_on_compat_buffer(megatron, world, backend):
    import tritonep.compat.deep_ep as compat

    saved = dict(compat.DEFAULTS)
    compat.DEFAULTS["backend"] = backend
    try:
        res = run_cpu_world(world, _fused_a2a, *megatron, timeout_s=600)
    finally:
        compat.DEFAULTS.update(saved)
    assert res == [[True] * 4] * world


@pytest.mark.parametrize("world,backend", [(2, "nccl"), (2, "triton"), (3, "nccl"),
                                           pytest.param(4, "nccl", marks=pytest.mark.slow)])
def test_flex_deepep_dispatcher_equals_alltoall(megatron, world, backend):
    import tritonep.compat.deep_ep as compat

    td = megatron[0]
    saved = dict(compat.DEFAULTS)
    compat.DEFAULTS["backend"] = backend
    try:
        flex = run_cpu_world(world, _dispatcher, "flex", td, 1, timeout_s=600)
    finally:
        compat.DEFAULTS.update(saved)
    a2a = run_cpu_world(world, _dispatcher, "alltoall", td, 1, timeout_s=600)
    for r in range(world):
        for name, f, a, tol in zip(("output", "grad tokens", "grad probs", "grad expert weights"), flex[r], a2a[r],
                                   TOLS):
            assert f.shape == a.shape, name
            err = (f.double() - a.double()).abs().max().item()
            assert err <= tol * a.double().abs().max().item(), (r, name, err)
