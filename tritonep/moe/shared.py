"""Shared experts: a dense FFN every token runs besides its routed experts (DeepSeek-V3, Qwen2-MoE).

``shared(x) = down_proj(act(gate_proj(x), up_proj(x)))`` for a gated activation (``act(h)`` with ``up_proj`` only
for a plain one), optionally scaled per token by ``sigmoid(gate(x))`` (Qwen2-MoE's ``shared_expert_gate``). DeepSeek-V3
fuses its ``n_shared_experts`` into one FFN of width ``n_shared_experts * moe_intermediate_size``; so does this
module. The parameters are plain ``nn.Linear`` weights with transformers' names, replicated on every rank (their
gradients are reduced with the other replicated parameters, docs/moe.md "Training"). It runs in its weights' dtype
with torch's own autograd, outside the layer's dispatch/combine op.

Idea sources: DeepSeekMoE (arXiv 2401.06066) shared expert isolation; transformers' ``DeepseekV3MoE`` and
``Qwen2MoeSparseMoeBlock``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError, InputError
from .activations import get_activation

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """Dense shared-expert FFN (module docstring).

    Args:
        hidden: H. intermediate: the FFN width I_s (> 0).
        activation: a name of :data:`tritonep.moe.ACTIVATIONS` (default ``"swiglu"``).
        gated_output: add the per-token ``sigmoid(gate(x))`` scale (``gate`` an ``nn.Linear(H, 1, bias=False)``).
        seed: initialisation seed (same on every rank; weights ``N(0, 1/fan_in)`` drawn on the CPU).
        device, dtype: of the weights (the layer's expert dtype).

    Forward: ``x [T, H]`` (any float dtype) -> ``[T, H]`` in the weights' dtype.

    Raises:
        ConfigError: a non-positive width or an unknown activation. InputError (forward): ``x`` not ``[T, H]``.
    """

    def __init__(self, hidden: int, intermediate: int, activation: str = "swiglu", gated_output: bool = False, *,
                 seed: int = 0, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if isinstance(intermediate, bool) or not isinstance(intermediate, int) or intermediate < 1:
            raise ConfigError(f"SharedExperts.intermediate must be a positive int, got {intermediate!r}")
        self.hidden, self.intermediate = hidden, intermediate
        self.act = get_activation(activation, "SharedExperts.activation")
        g = torch.Generator().manual_seed(int(seed) * 31337 + 7)

        def linear(n_in, n_out):
            lin = nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in))
            return lin

        if self.act.gated:
            self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)
        self.gate = linear(hidden, 1) if gated_output else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise InputError(f"shared experts input must be [T, {self.hidden}], got shape {tuple(x.shape)}")
        xa = x.to(self.up_proj.weight.dtype)
        up = self.up_proj(xa)
        if self.act.gated:
            a = self.act.fn(self.gate_proj(xa).float(), up.float())
        else:
            a = self.act.fn(up.float())
        out = self.down_proj(a.to(xa.dtype))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(xa)) * out
        return out

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, intermediate={self.intermediate}, activation={self.act.name}, " \
               f"gated_output={self.gate is not None}"
