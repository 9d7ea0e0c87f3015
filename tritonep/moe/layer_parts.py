"""Pieces of :class:`tritonep.moe.layer.MoELayer` that need no layer instance: the per-step virtual-expert facts,
the seeded expert weight draw and the symmetric-memory size of a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from ..backends import check_backend_name, services_bytes
from ..ep import EPBuffer
from .counter_rng import counter_normal, stream_key
from .recipe import MoEGeometry, MoERecipe, check_config

_ACT_DTYPE = torch.bfloat16  # tokens, received rows and expert outputs travel in bf16

__all__ = ["expert_weights", "expert_shapes", "layer_required_bytes"]


@dataclass(frozen=True)
class _Split:
    """Host facts of one virtual-expert step on this rank (read once after dispatch).

    ``native_end``: rows of the native experts (``expert_offsets[L-1]``); ``num_used``: virtual slots used;
    ``held``: this rank's native expert indices some peer runs this step; ``experts_to_copy``: the placement's
    ``[W, L]`` slot contents (host lists; the nccl transport's split sizes).
    """

    native_end: int
    num_used: int
    held: list
    experts_to_copy: list


def expert_weights(geometry: MoEGeometry, seed: int, dtype: torch.dtype, experts: Iterable[int], device=None):
    """Weights of the given global experts, drawn on ``device`` (default CPU); see :meth:`tritonep.MoELayer.init_expert_weights`.

    Returns ``(w1 [n, H, width], w2 [n, I, H])`` in ``dtype`` on ``device`` (n = number of experts; width =
    ``geometry.w1_width``, 2I for the gated activations). Expert e's tensors are the counter-based streams
    ``(seed, e, 1)`` and ``(seed, e, 2)`` of :func:`tritonep.moe.counter_rng.counter_normal`, written straight into
    the preallocated output: the same values on every device and SM count (``torch.randn`` on CUDA depends on the
    SM count the process sees, which MPS lowers for ranks sharing a GPU).
    """
    H, inter, width = geometry.hidden, geometry.intermediate, geometry.w1_width
    device = torch.device("cpu") if device is None else torch.device(device)
    experts = [int(e) for e in experts]
    w1 = torch.empty(len(experts), H, width, dtype=dtype, device=device)
    w2 = torch.empty(len(experts), inter, H, dtype=dtype, device=device)
    for i, e in enumerate(experts):
        counter_normal(stream_key(seed, e, 1), (H, width), out=w1[i], std=1.0 / math.sqrt(H))
        counter_normal(stream_key(seed, e, 2), (inter, H), out=w2[i], std=1.0 / math.sqrt(inter))
    return w1, w2


def expert_shapes(geometry: MoEGeometry) -> dict:
    """Per-expert weight shapes of a layer (what its expert transport moves): ``{"w1": (H, w1_width), "w2": (I, H)}``
    (``w1_width`` = 2I for the gated activations)."""
    g = geometry
    return {"w1": (g.hidden, g.w1_width), "w2": (g.intermediate, g.hidden)}


def layer_required_bytes(recipe: MoERecipe, geometry: MoEGeometry, world_size: int, device_type: str | None,
                         dtype: torch.dtype, backend: str = "auto") -> int:
    """Body of :meth:`tritonep.MoELayer.required_bytes`: symmetric bytes of one rank's layer (EPBuffer, plus the
    counts exchange and the expert slots with virtual experts, as the backend sizes them: 0 for one that holds no
    symmetric memory). Raises ConfigError as the layer's constructor, and for a ``backend`` that is not ``"auto"``
    or a registered name."""
    check_config(recipe, geometry, world_size)
    check_backend_name(backend)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    g = geometry
    virtual = recipe.balance == "virtual"
    total = EPBuffer.required_bytes(world_size=world_size, num_experts=g.num_experts * (2 if virtual else 1),
                                    hidden=g.hidden, max_tokens_per_rank=g.max_tokens_per_rank, topk=g.topk,
                                    dispatch_wire=recipe.dispatch_wire, combine_wire=recipe.combine_wire,
                                    expert_alignment=recipe.expert_alignment, max_recv_tokens=g.max_recv_tokens,
                                    dtype=_ACT_DTYPE, device_type=device_type, backend=backend)
    if virtual:
        total += services_bytes(backend, world_size=world_size, num_experts=g.num_experts,
                                max_tokens_per_rank=g.max_tokens_per_rank, shapes=expert_shapes(g), dtype=dtype)
    return total


def take_part_refused(buffer, counts_x, err: Exception, sync_free: bool = False, kind: str | None = None,
                      virtual: bool = False):
    """A rank whose forward input was refused before its dispatch runs the rest of the call's collective sequence
    as a refused call, so every rank fails the forward together (the others raise
    :class:`tritonep.errors.PeerInputError`; docs/protocols.md (host protocol rule)), then raises ``err``.

    Args:
        buffer: the layer's :class:`tritonep.EPBuffer`; its dispatch takes part with no tokens and the flag.
        counts_x: the planner's counts exchange (:class:`tritonep.backends.CountsExchange`) when its exchange
            has not run yet in this call (virtual experts), else None.
        err: the refusal to raise on this rank.
        sync_free: the layer's ``MoERecipe.sync_free`` (the refused dispatch is the same kind of call as the
            peers'). kind: the layer's combine kind. virtual: ``balance='virtual'`` (the peers read the counts
            exchange's record after their dispatch and raise before any combine).

    Without virtual experts, a refused dispatch that read nothing (sync-free, sync checks off:
    :attr:`tritonep.EPBuffer.last_dispatch_read`) raised on this rank only: the peers go on to their combine, so
    this rank takes part in it as refused (:meth:`tritonep.EPBuffer.cancel_combine`; :func:`cancel_unread_refusal`).
    """
    import torch

    from ..errors import CapacityError, InputError

    if counts_x is not None:
        try:
            counts_x.gather(None)  # refused on purpose: takes part with no routes and the flag
        except (InputError, CapacityError):
            pass
    H, K, dev = buffer.hidden, buffer.topk, buffer.device
    try:  # a row width the buffer refuses on purpose: it takes part with no tokens and the flag
        buffer.dispatch(torch.empty(0, H + 1, dtype=torch.bfloat16, device=dev),
                        torch.empty(0, K, dtype=torch.int64, device=dev),
                        torch.empty(0, K, dtype=torch.float32, device=dev), sync_free=sync_free)
    except (InputError, CapacityError):
        if not virtual:
            cancel_unread_refusal(buffer, kind)
    raise err


def cancel_unread_refusal(buffer, kind: str | None) -> None:
    """After this rank's dispatch raised its own refusal: if the call read nothing (sync-free, sync checks off), the
    peers raised nothing and go on to their combine, so take part in it as refused
    (:meth:`tritonep.EPBuffer.cancel_combine`: their output is NaN, every rank's next ``check()`` raises
    :class:`tritonep.errors.PeerInputError` naming this rank); else (a read: every rank raised) nothing."""
    if not buffer.last_dispatch_read:
        buffer.cancel_combine(None, kind=kind)


def combine_grad(grad_y: torch.Tensor) -> torch.Tensor:
    """The MoE layer's combine backward input: ``grad_y [T, H]`` (the layer op's output gradient) as contiguous
    bf16 (a copy unless it is one already; may run out of memory like any allocation)."""
    return grad_y.to(_ACT_DTYPE).contiguous()


def _raise_when_backward_ends(exc: Exception) -> bool:
    """Queue ``exc`` to be raised when the running autograd backward pass has run every node (the engine's final
    callbacks: the error leaves ``backward()`` / ``autograd.grad`` after the earlier layers' collectives ran); False
    where no backward pass is running (the caller raises it then)."""
    def fire():
        raise exc

    try:
        torch.autograd.Variable._execution_engine.queue_callback(fire)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


def take_part_failed_backward(layer, exc: Exception, st: dict):
    """The rest of a :class:`tritonep.MoELayer` backward on a rank whose own part failed (``exc``: its expert FFN
    backward raised, e.g. out of memory, or the gradient's cast before the combine backward), after its combine
    backward took part (as a real or a cancelled call): every later collective of the backward takes part as on the
    peers, so no peer waits for this rank and none returns a value computed without its rows (the host protocol
    rule). With virtual experts the weight transport's pull runs with NaN slot gradients (the owners' weight
    gradients of the experts this rank ran become NaN); the dispatch backward takes part as cancelled
    (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`): the peers' ``grad_x`` / ``grad_topk_weights`` are NaN (on
    the nccl backend every element computed from this rank's rows) and every rank's next ``check()`` or synced
    dispatch raises :class:`tritonep.errors.PeerInputError` naming this rank.

    Then returns NaN gradients ``(grad_x [T, H] bf16, grad_topk_weights [T, K] float32, grad_w1, grad_w2)`` shaped
    as the layer's, so the rest of this rank's backward runs too -- the MoE layers before this one take part in
    their own collectives, which the peers wait for -- and raises ``exc`` when the backward pass ends (an autograd
    engine callback, as FSDP queues its post-backward work; outside a running backward pass: at once). With
    ``MoERecipe(sync_free=True)`` (no rank raises inside a step: the peers run on through their next step, which
    needs this rank) it defers ``exc`` to this rank's next ``check()`` (:meth:`tritonep.EPBuffer.defer`) instead.
    Idea: the forward's ``cancel_combine`` / ``defer`` path, for the backward half.

    Args:
        layer: the MoE layer (its ``buffer``, ``transport``, ``virtual``, ``recipe``).
        exc: this rank's error. st: the call's saved state (``handle``, ``w1`` / ``w2`` parts, ``split``,
            ``placement``).

    Raises:
        ``exc`` (not sync-free), when no backward pass is running to raise it at its end.
    """
    from .layer_status import strict_check

    buf, handle, nan = layer.buffer, st["handle"], float("nan")
    if layer.virtual:  # the pull is a collective: NaN slot gradients, so the owners' gradients cannot pass either
        sp = st["split"]
        g1 = [torch.full_like(w, nan) for w in st["w1"]]
        g2 = [torch.full_like(w, nan) for w in st["w2"]]
        layer.transport.pull({"w1": g1[1], "w2": g2[1]}, st["placement"], sp.num_used, sp.held,
                             into={"w1": g1[0], "w2": g2[0]}, experts_to_copy_host=sp.experts_to_copy)
        strict_check(layer.transport, buf)
    buf.cancel_dispatch_backward(handle, with_weights=True)  # the peers pass the combine backward's row weights
    if layer.recipe.sync_free:
        buf.defer(exc)
    elif not _raise_when_backward_ends(exc):
        raise exc
    T, K = handle.num_tokens, buf.topk
    return (torch.full((T, buf.hidden), nan, dtype=_ACT_DTYPE, device=buf.device),
            torch.full((T, K), nan, dtype=torch.float32, device=buf.device),
            torch.full_like(st["w1"][0], nan), torch.full_like(st["w2"][0], nan))
