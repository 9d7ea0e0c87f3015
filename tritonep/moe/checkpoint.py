"""Checkpoints of models with expert-parallel MoE layers: model and optimizer state keyed by global expert id, saved
and loaded with ``torch.distributed.checkpoint`` (DCP), reshardable to any EP size (docs/moe.md "Checkpoints").

A plain ``state_dict()`` of rank-local expert tensors would have every rank save a different ``moe.w1`` under the
same name (DCP keeps one rank's copy of a name it sees on several ranks: the other experts would be lost). Instead:

* model: :class:`tritonep.MoELayer`'s ``state_dict`` keys its experts ``<layer>.experts.<e>.w1`` / ``.w2``
  (:mod:`tritonep.moe.params`): every expert is saved once (DP replicas hold the same keys and values), and a rank
  loads exactly the experts it holds at the EP size it runs at;
* optimizer: :func:`optimizer_state_dict` splits the state of every expert parameter the same way
  (``<layer>.experts.<e>.w1`` -> ``{"exp_avg": [H, width], "step": ...}``); replicated parameters keep their FQN;
  ``param_groups`` keep their hyperparameters (no parameter ids).

:func:`save` / :func:`load` wrap both into one DCP call each (collective over ``group``, every rank the same keys it
holds). Loading reads in place into the model's parameters and the optimizer's state (created first by
:func:`init_optimizer_state` if the optimizer has not stepped yet). Everything else a resume needs (the step counter,
data position, RNG states) goes in ``extra`` (small picklable values, identical on every rank).

Idea source: ``torch.distributed.checkpoint`` (DCP) and its ``state_dict`` utilities (FQN-keyed optimizer state).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["optimizer_state_dict", "load_optimizer_state_dict", "init_optimizer_state", "save", "load"]


def _param_keys(model: nn.Module) -> dict:
    """``id(param) -> (fqn, None)`` for replicated parameters, ``(layer prefix, (name, expert ids))`` for experts."""
    from .layer import MoELayer
    from .params import EXPERT_WEIGHTS

    keys = {}
    for prefix, mod in model.named_modules():
        if isinstance(mod, MoELayer):
            p = prefix + "." if prefix else ""
            for name in EXPERT_WEIGHTS:
                keys[id(getattr(mod, name))] = (p, (name, list(mod.expert_ids)))
    for fqn, param in model.named_parameters():
        keys.setdefault(id(param), (fqn, None))
    return keys


def _optimizer_params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state keyed by parameter FQN, with every expert parameter's state split per global expert.

    Returns:
        ``{"state": {key: {name: value}}, "param_groups": [hyperparameters of each group]}``. For an expert
        parameter ``[L, ...]`` each local expert e gets ``key = "<layer>.experts.<e>.<w1|w2>"`` and the ``[...]``
        slice of every state tensor shaped like the parameter (views: loading in place fills the optimizer), other
        values (``step``) as they are. Parameters without state are absent.

    Raises:
        ConfigError: the optimizer holds a parameter that is not in ``model``.
    """
    keys = _param_keys(model)
    state = {}
    for p in _optimizer_params(optimizer):
        if id(p) not in keys:
            raise ConfigError("the optimizer holds a parameter that is not in the model")
        st = optimizer.state.get(p)
        if not st:
            continue
        base, expert = keys[id(p)]
        if expert is None:
            state[base] = dict(st)
            continue
        name, ids = expert
        for j, e in enumerate(ids):
            state[f"{base}experts.{e}.{name}"] = {k: (v[j] if torch.is_tensor(v) and v.shape == p.shape else v)
                                                  for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Put :func:`optimizer_state_dict`'s layout back into ``optimizer`` (this rank's experts; others ignored).

    Tensors are copied into the optimizer's existing state (created with :func:`init_optimizer_state` when absent);
    other values and the groups' hyperparameters are assigned.

    Raises:
        ConfigError: a state entry this rank needs is missing, or the number of param groups differs.
    """
    keys = _param_keys(model)
    init_optimizer_state(optimizer)
    saved = state_dict["state"]
    for p in _optimizer_params(optimizer):
        base, expert = keys[id(p)]
        st = optimizer.state[p]
        entries = [(base, None)] if expert is None else \
            [(f"{base}experts.{e}.{expert[0]}", j) for j, e in enumerate(expert[1])]
        for key, j in entries:
            if key not in saved:
                raise ConfigError(f"optimizer state has no entry {key!r}")
            for k, v in saved[key].items():
                cur = st.get(k)
                if torch.is_tensor(v) and torch.is_tensor(cur):
                    (cur[j] if j is not None and cur.shape == p.shape else cur).copy_(v)
                else:
                    st[k] = v
    if len(state_dict["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError(f"{len(state_dict['param_groups'])} saved param groups, the optimizer has "
                          f"{len(optimizer.param_groups)}")
    for g, saved_g in zip(optimizer.param_groups, state_dict["param_groups"]):
        g.update({k: v for k, v in saved_g.items() if k != "params"})


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state if it has none yet, without changing any parameter: one ``step()`` with zero
    gradients and a learning rate of 0 (the trick of torch.distributed.checkpoint's state_dict utilities), then the
    gradients are cleared. No-op when the optimizer already has state or a gradient exists."""
    params = _optimizer_params(optimizer)
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def save(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
         group=None) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``) with DCP into the directory ``path`` (collective over
    ``group``, default: the world; every rank of every DP replica calls it)."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": model.state_dict()}
    if optimizer is not None:
        sd["optim"] = optimizer_state_dict(model, optimizer)
    if extra is not None:
        sd["extra"] = dict(extra)
    dcp.save(sd, checkpoint_id=str(path), process_group=group)


def load(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
         group=None) -> dict | None:
    """Load what :func:`save` wrote into ``model`` (and ``optimizer``) at this run's EP size (collective).

    Args:
        extra: a dict of the same keys as saved (values are placeholders of the same type); returned filled.

    Returns:
        the loaded ``extra`` (None when not asked for).

    Raises:
        ConfigError: missing optimizer entries; DCP's own errors for keys absent from the checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    sd = {"model": model.state_dict()}
    if optimizer is not None:
        init_optimizer_state(optimizer)
        sd["optim"] = optimizer_state_dict(model, optimizer)
    if extra is not None:
        sd["extra"] = dict(extra)
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
    model.load_state_dict(sd["model"])
    if optimizer is not None:
        load_optimizer_state_dict(model, optimizer, sd["optim"])
    return sd.get("extra")

