"""The expert FFN's activation, pluggable: a small registry of :class:`ExpertActivation` (docs/moe.md).

An expert computes ``out = act(x @ w1) @ w2``. A *gated* activation splits ``h = x @ w1`` (``[R, 2I]``) into the gate
(first I columns) and the up projection (last I) and returns ``f(gate) * up`` (SwiGLU: ``f = silu``, the FFN of
Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3); a plain one returns ``f(h)`` (``h [R, I]``). Every activation is computed
in float32 and rounded to ``h``'s dtype. ``swiglu`` has a hand-written backward (the layer's default path);
the others differentiate their elementwise torch function with ``torch.func.vjp`` inside the layer's backward, so a
new one is a few lines: ``register_activation("name", fn, gated=...)``.

Built in: ``swiglu`` (gated, silu), ``geglu`` (gated, exact gelu), ``gelu`` (plain, exact gelu), ``relu2``
(plain, squared ReLU; Primer / Nemotron-style).

Idea sources: GLU variants (Shazeer 2020, "GLU Variants Improve Transformer"); transformers' ``ACT2FN`` table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError

__all__ = ["ExpertActivation", "ACTIVATIONS", "register_activation", "get_activation", "swiglu_torch"]


def swiglu_torch(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` computed in fp32 and returned in ``h.dtype``; ``h [R, 2I]`` -> ``[R, I]``."""
    inter = h.shape[1] // 2
    g, u = h[:, :inter].float(), h[:, inter:].float()
    return (F.silu(g) * u).to(h.dtype)


def _swiglu_backward(h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    inter = h.shape[1] // 2
    g, u = h[:, :inter].float(), h[:, inter:].float()
    sig = torch.sigmoid(g)
    ga = grad_a.float()
    grad_g = ga * u * (sig * (1.0 + g * (1.0 - sig)))
    grad_u = ga * (g * sig)
    return torch.cat([grad_g, grad_u], dim=1).to(h.dtype)


@dataclass(frozen=True)
class ExpertActivation:
    """One expert activation.

    Attributes:
        name: registry name (what :class:`tritonep.MoEGeometry.activation` holds).
        gated: True: ``fn(gate, up)`` on the two halves of ``h [R, 2I]``; False: ``fn(h)`` on ``h [R, I]``.
        fn: elementwise, differentiable torch function of float32 tensors (one or two of them).
        hand_backward: optional ``(h, grad_a) -> grad_h`` (in ``h.dtype``) that replaces ``torch.func.vjp`` of
            ``fn``.
    """

    name: str
    gated: bool
    fn: Callable
    hand_backward: Callable | None = None

    def width(self, intermediate: int) -> int:
        """Columns of ``w1`` (and of ``h``): ``2 * intermediate`` when gated, else ``intermediate``."""
        return 2 * intermediate if self.gated else intermediate

    def _apply(self, hf: torch.Tensor) -> torch.Tensor:
        if self.gated:
            inter = hf.shape[1] // 2
            return self.fn(hf[:, :inter], hf[:, inter:])
        return self.fn(hf)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``a [R, I]`` from ``h [R, width]``, computed in float32, returned in ``h.dtype``."""
        if self.name == "swiglu":
            return swiglu_torch(h)
        return self._apply(h.float()).to(h.dtype)

    def backward(self, h: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
        """``grad_h [R, width]`` (``h.dtype``) from the forward's ``h`` and ``grad_a [R, I]`` (float32 math)."""
        if self.hand_backward is not None:
            return self.hand_backward(h, grad_a)
        # torch.func.vjp, not torch.autograd.grad: inside the layer's custom op autograd does not record
        _, vjp = torch.func.vjp(self._apply, h.detach().float())
        (g,) = vjp(grad_a.float())
        return g.to(h.dtype)


ACTIVATIONS: dict[str, ExpertActivation] = {}
"""name -> :class:`ExpertActivation`; extend with :func:`register_activation`."""


def register_activation(name: str, fn: Callable, gated: bool, hand_backward: Callable | None = None
                        ) -> ExpertActivation:
    """Add an expert activation under ``name`` (then ``MoEGeometry(activation=name)`` selects it).

    Args:
        name: a new name (str). fn: elementwise torch function on float32 tensors, ``fn(gate, up)`` when ``gated``
            else ``fn(h)``; differentiable by ``torch.func.vjp`` (its backward unless ``hand_backward`` is given).
        gated: see :class:`ExpertActivation`. hand_backward: optional ``(h, grad_a) -> grad_h``.

    Every rank must register the same activations before building its layers.

    Raises:
        ConfigError: ``name`` is not a str, is already registered, or ``fn`` is not callable.
    """
    if not isinstance(name, str) or not name or name in ACTIVATIONS:
        raise ConfigError(f"activation name {name!r} must be a new non-empty str (registered: {sorted(ACTIVATIONS)})")
    if not callable(fn) or not isinstance(gated, bool):
        raise ConfigError(f"activation {name!r}: fn must be callable and gated a bool, got {fn!r}, {gated!r}")
    act = ExpertActivation(name, gated, fn, hand_backward)
    ACTIVATIONS[name] = act
    return act


def get_activation(name: str, field: str = "activation") -> ExpertActivation:
    """The registered activation ``name``. Raises ConfigError naming ``field``, the value and the known names."""
    act = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if act is None:
        raise ConfigError(f"{field}={name!r} is not a registered expert activation; known: {sorted(ACTIVATIONS)}")
    return act


register_activation("swiglu", lambda g, u: F.silu(g) * u, gated=True, hand_backward=_swiglu_backward)
register_activation("geglu", lambda g, u: F.gelu(g) * u, gated=True)
register_activation("gelu", F.gelu, gated=False)
register_activation("relu2", lambda h: torch.relu(h).square(), gated=False)
