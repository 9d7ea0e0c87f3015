"""Which parameters of an MoE model are expert-parallel and which are replicated, how their gradients are reduced,
and the layer's checkpoint keys (docs/moe.md "Training").

Expert-parallel (EP) parameters: every :class:`tritonep.MoELayer`'s ``w1`` / ``w2``, different on every rank of an EP
group (rank r holds experts ``[r*L, (r+1)*L)``). Replicated: everything else (routers, shared experts, attention,
norms, embeddings), identical on every rank.

Gradients with data parallel (DP) x EP, ``N = D * W`` ranks, each rank's loss the mean over ITS tokens and the
objective the mean over all N ranks' losses:

* a replicated parameter's gradient on a rank covers only that rank's tokens (each rank of an EP group routes its own
  micro-batch, so router gradients differ per rank after backward): sum over all N ranks, divide by N;
* an expert's gradient on a rank already covers the tokens of all W ranks of its EP group (dispatch brought them);
  the D ranks that hold the same experts (the "expert DP group": same EP rank, other DP replicas) sum theirs, then
  divide by N (not by D: each EP group's sum already spans W ranks' losses).

:func:`reduce_gradients` does both (two collectives per call, in fp32). With DDP, leave the expert parameters out of
DDP (``DDP._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))``) so DDP averages only
the replicated ones over the world, and call ``reduce_gradients(model, world, expert_dp_group,
replicated=False)`` after backward. FSDP2: docs/moe.md (the experts' FSDP module divides by N).

Checkpoint keys: a layer's ``state_dict`` holds its experts under their GLOBAL id, ``<prefix>experts.<e>.w1``
(``[H, width]``) and ``<prefix>experts.<e>.w2`` (``[I, H]``), views of the parameters (so ``torch.distributed.checkpoint``
loads in place), instead of a rank-local ``w1`` that every rank would save under the same name. Loading takes this
rank's experts from such keys and ignores the keys of the model's other experts, so a checkpoint saved at one EP size
loads at any other (and a full single-file state dict loads on every rank); keys of experts the model does not have
are unexpected, this rank's absent expert keys missing (torch's ``strict`` rules).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["expert_parameters", "replicated_parameters", "expert_parameter_names", "reduce_gradients",
           "expert_state_dict_hook", "expert_load_state_dict_pre_hook", "expert_load_state_dict_post_hook",
           "EXPERT_WEIGHTS"]

EXPERT_WEIGHTS = ("w1", "w2")
"""The expert-parallel parameter names of a :class:`tritonep.MoELayer`."""


def _moe_layers(model: nn.Module):
    """The modules of ``model`` that declare expert-parallel weights (``MoELayer.expert_parallel_weights``; no
    import of the layer, which imports this module)."""
    return [m for m in model.modules() if getattr(type(m), "expert_parallel_weights", None) == EXPERT_WEIGHTS]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every expert-parallel parameter of ``model`` (the ``w1`` / ``w2`` of each MoELayer in it), module order."""
    return [getattr(m, n) for m in _moe_layers(model) for n in EXPERT_WEIGHTS]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The fully qualified names (``model.named_parameters()``) of :func:`expert_parameters`."""
    ids = {id(p) for p in expert_parameters(model)}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter of ``model`` (same on every rank; gradients reduced over the whole DP x EP world)."""
    ids = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in ids]


@torch.no_grad()
def _sum_into_grads(params, group, divisor: float) -> None:
    """One fp32 all_reduce (sum) of the gradients of ``params`` over ``group``, divided by ``divisor``; a missing
    gradient counts as zeros (and is set), so every rank sends the same sizes."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in params])
    if group is not None:
        dist.all_reduce(flat, group=group)
    if divisor != 1:
        flat.div_(divisor)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(g.view_as(p))


def reduce_gradients(model: nn.Module, group=None, expert_dp_group=None, *, replicated: bool = True) -> None:
    """Reduce the gradients of a DP x EP model after backward (module docstring): the replicated parameters' summed
    over ``group`` and the experts' over ``expert_dp_group``, both divided by ``group``'s size N.

    Args:
        model: the model (every rank passes the same architecture: the collectives must match).
        group: all ranks that share the replicated parameters (DP x EP; None: the default world group).
        expert_dp_group: the ranks that hold the same experts (one per DP replica); None when D = 1 (no expert
            collective, the expert gradients are only divided by N = W).
        replicated: False when DDP already averaged the replicated gradients (only the experts are reduced).

    Collective: one all_reduce for the replicated gradients (when ``replicated``), one for the experts' (when
    ``expert_dp_group`` is given), in that order, on every rank.
    """
    if group is None:
        group = dist.group.WORLD
    n = dist.get_world_size(group)
    if replicated:
        _sum_into_grads(replicated_parameters(model), group, n)
    _sum_into_grads(expert_parameters(model), expert_dp_group, n)


# ---------------------------------------------------------------------------------------------- checkpoint keys
def _key(prefix: str, expert: int, name: str) -> str:
    return f"{prefix}experts.{expert}.{name}"


def expert_state_dict_hook(layer, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook of MoELayer: replace ``<prefix>w1`` / ``<prefix>w2`` by one entry per local expert
    keyed by its global id (views of the parameters)."""
    for name in EXPERT_WEIGHTS:
        full = state_dict.pop(prefix + name, None)
        if full is None:
            continue
        for j, e in enumerate(layer.expert_ids):
            state_dict[_key(prefix, e, name)] = full[j]


def expert_load_state_dict_pre_hook(layer, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                                    unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook of MoELayer: stack this rank's experts' global-id keys into ``<prefix>w1`` /
    ``<prefix>w2`` and drop the keys of the model's experts other ranks hold (a checkpoint of any EP size loads).

    Reported as torch reports them (``strict=True`` raises, naming them; ``strict=False`` returns them): a key of an
    expert id outside the model's ``[0, num_experts)`` or of an unknown weight name stays in ``state_dict`` and is an
    unexpected key; a missing expert key of this rank is a missing key under its own name
    (``<prefix>experts.<e>.w1``: :func:`expert_load_state_dict_post_hook` puts it in place of ``<prefix>w1``, which
    then stays unloaded)."""
    local = set(layer.expert_ids)
    E = layer.num_local_experts * layer.world_size
    head = prefix + "experts."
    for key in [k for k in state_dict if k.startswith(head)]:
        parts = key[len(head):].split(".")
        if len(parts) == 2 and parts[0].isdigit() and parts[1] in EXPERT_WEIGHTS and int(parts[0]) < E \
                and int(parts[0]) not in local:
            del state_dict[key]
    layer._missing_expert_keys = missing = {}
    for name in EXPERT_WEIGHTS:
        keys = [_key(prefix, e, name) for e in layer.expert_ids]
        present = [k for k in keys if k in state_dict]
        if len(present) < len(keys):
            missing[prefix + name] = [k for k in keys if k not in state_dict]
            for k in present:
                del state_dict[k]
            continue
        state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])


def expert_load_state_dict_post_hook(layer, incompatible_keys) -> None:
    """``load_state_dict`` post-hook of MoELayer: a stacked ``<prefix>w1`` / ``<prefix>w2`` torch found missing is
    reported as the expert keys it lacked (the names ``state_dict()`` gives), in place (torch then raises with
    ``strict=True``)."""
    missing = getattr(layer, "_missing_expert_keys", None) or {}
    layer._missing_expert_keys = None
    keys = incompatible_keys.missing_keys
    for stacked, expert_keys in missing.items():
        if stacked in keys:
            keys.remove(stacked)
        keys.extend(k for k in expert_keys if k not in keys)


def local_expert_ids(layer) -> Iterator[int]:
    """Global ids of the experts this rank holds, in ``w1`` / ``w2`` order."""
    lo = layer.rank * layer.num_local_experts
    return range(lo, lo + layer.num_local_experts)
