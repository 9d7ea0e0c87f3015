"""The MoE layer takes ``[..., H]`` tokens (transformers' ``[B, S, H]``, a single ``[H]`` token) in bfloat16,
float16 or float32 and returns the caller's shape and dtype; its gradient has the input's dtype too.

Checked in CPU worlds on both backends against the same tokens as a ``[T, H]`` bf16 call (bit for bit for bf16,
whose values travel unchanged) and against the dense fp32 reference (every dtype); explicit routing ``[..., K]``
follows the tokens' shape. Another dtype or hidden size is refused on every rank (InputError on the bad rank,
PeerInputError elsewhere), the layer usable afterwards.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import InputError
from tritonep.reference import moe_dense_reference
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.outcomes import verdict

H, I = 64, 32


def _geo(W):
    return tep.MoEGeometry(hidden=H, intermediate=I, num_experts=2 * W, topk=2, max_tokens_per_rank=12)


def _world(group, backend):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    layer = tep.MoELayer(tep.MoERecipe(), _geo(W), group, seed=5, backend=backend)
    x, idx, w = make_rank_inputs(rank, 6, H, 2 * W, 2, seed=9, mask_frac=0.0)
    base = layer(x, idx, w).detach()
    out = dict(base=base, x=x, idx=idx, w=w, cases={})
    for name, dt, shape in (("bf16_bsh", torch.bfloat16, (2, 3, H)), ("fp16_bsh", torch.float16, (3, 2, H)),
                            ("fp32_bsh", torch.float32, (1, 6, H)), ("fp32_2d", torch.float32, (6, H))):
        xi = x.to(dt).reshape(shape).clone().requires_grad_(True)
        y = layer(xi, idx.reshape(*shape[:-1], 2), w.reshape(*shape[:-1], 2))
        y.float().sum().backward()
        out["cases"][name] = dict(shape=tuple(y.shape), dtype=y.dtype, y=y.detach().float().reshape(-1, H),
                                  gdtype=xi.grad.dtype, gshape=tuple(xi.grad.shape))
    one = layer(x[0])  # one token as [H], routed by the router
    out["one"] = (tuple(one.shape), one.dtype)
    out["bad"] = [verdict(lambda: layer(wrong, idx, w).shape, InputError)  # a refused call on one rank each
                  for wrong in (x.double() if rank == 0 else x, x[:, :H - 1] if rank == W - 1 else x)]
    out["after"] = torch.equal(layer(x, idx, w).detach(), base)
    layer.close()
    return out


@pytest.mark.parametrize("W,backend", [pytest.param(2, "triton", marks=pytest.mark.slow), (3, "nccl")])
def test_layer_takes_any_leading_shape_and_float_dtype(W, backend):
    res = run_cpu_world(W, _world, backend, timeout_s=240)
    w1, w2 = tep.MoELayer.init_expert_weights(_geo(W), seed=5)
    for r, out in enumerate(res):
        ref = moe_dense_reference(out["x"], out["idx"], out["w"], w1, w2)
        for name, c in out["cases"].items():
            dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name[:4]]
            assert c["dtype"] == dt and c["gdtype"] == dt, (name, c["dtype"], c["gdtype"])
            assert c["shape"] == c["gshape"] and c["shape"][-1] == H, (name, c["shape"])
            assert torch.allclose(c["y"], ref, rtol=2 ** -5, atol=2 ** -5), name
            if dt == torch.bfloat16:
                assert torch.equal(c["y"], out["base"].float()), name  # the tokens travel unchanged
        assert out["one"] == ((H,), torch.bfloat16)
        assert out["bad"][0] == (("InputError", out["bad"][0][1]) if r == 0 else ("PeerInputError", [0])), out["bad"]
        assert "float64" in out["bad"][0][1] if r == 0 else True
        assert out["bad"][1] == (("InputError", out["bad"][1][1]) if r == W - 1 else ("PeerInputError", [W - 1]))
        assert out["after"]
