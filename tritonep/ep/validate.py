"""Front-door checks of every EPBuffer call, run before any peer is touched (shared by all backends).

Policy (documented in docs/guarantees.md): a non-contiguous ``x`` / ``expert_out`` is copied to a contiguous
tensor (same values, never wrong data); ``topk_weights`` of another float dtype is converted to float32; everything
else that does not match is refused with :class:`tritonep.errors.InputError` or
:class:`tritonep.errors.CapacityError` naming the value.
"""

from __future__ import annotations

import torch

from ..backends.checks import check_expert_ids
from ..errors import CapacityError, ConfigError, InputError

__all__ = ["check_dispatch_inputs", "check_count_ids", "check_combine_inputs", "check_backward_inputs", "check_expert_ids"]

_ID_DTYPES = (torch.int32, torch.int64)


def check_dispatch_inputs(x, topk_idx, topk_weights, hidden, topk, max_tokens_per_rank, dtype, device,
                          rank_mask=None):
    """Validate dispatch inputs; returns ``(x, topk_idx, topk_weights)`` contiguous, weights float32.

    ``rank_mask``: whether ``topk_idx`` may be a bool rank mask ``[T, W]`` (a buffer whose ``topk`` is its world
    size: route k goes to expert ``k * L``, the first local expert of rank k, where set; else no route): None
    refuses it (InputError), True keeps it (the kernels read it: the triton backend's decode tiles), an int32
    ``[W]`` tensor of those expert ids converts it here (one ``torch.where``: the other paths).

    Cheap by design (Python ints and attributes, no device read, no copy of what already conforms): it runs on
    every call's host path (the buffer passes its static arguments positionally, from one tuple made at
    construction).

    Raises:
        InputError: wrong type, dtype, device, rank or shape (message names the tensor and the value).
        CapacityError: more tokens than ``max_tokens_per_rank``.
    """
    T_ = torch.Tensor
    if not (isinstance(x, T_) and isinstance(topk_idx, T_) and isinstance(topk_weights, T_)):
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, T_):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.device != device or topk_idx.device != device or topk_weights.device != device:
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if t.device != device:
                raise InputError(f"{name} is on {t.device}, the buffer is on {device}")
    xs = x.shape
    if len(xs) != 2 or xs[1] != hidden:
        raise InputError(f"x must have shape [num_tokens, hidden={hidden}], got {tuple(xs)}")
    if x.dtype != dtype:
        raise InputError(f"x must be {dtype}, got {x.dtype}")
    T = xs[0]
    if T > max_tokens_per_rank:
        raise CapacityError(f"num_tokens={T} exceeds max_tokens_per_rank={max_tokens_per_rank}",
                            needed=T, available=max_tokens_per_rank)
    idt = topk_idx.dtype
    if idt not in _ID_DTYPES and (idt is not torch.bool or rank_mask is None):
        raise InputError(f"topk_idx must be int32 or int64{'' if rank_mask is None else ' or a bool rank mask'}, "
                         f"got {idt}")
    if topk_idx.shape != (T, topk):
        raise InputError(f"topk_idx must have shape [num_tokens={T}, topk={topk}], got {tuple(topk_idx.shape)}")
    if idt is torch.bool and rank_mask is not True:
        topk_idx = torch.where(topk_idx, rank_mask, -1)
    if topk_weights.shape != (T, topk):
        raise InputError(f"topk_weights must have shape [num_tokens={T}, topk={topk}], "
                         f"got {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        if not topk_weights.is_floating_point():
            raise InputError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        topk_weights = topk_weights.to(torch.float32)
    if not x.is_contiguous():
        x = x.contiguous()
    if not topk_idx.is_contiguous():
        topk_idx = topk_idx.contiguous()
    if not topk_weights.is_contiguous():
        topk_weights = topk_weights.contiguous()
    return x, topk_idx, topk_weights


def check_count_ids(count_ids, count_experts, cfg, device, count_weights=None, carries=False, T=0):
    """``(count_ids, count_experts, Tc, CK)`` of :meth:`tritonep.EPBuffer.dispatch`'s count routing, checked:
    ``count_ids`` a 2-D int32 / int64 tensor ``[Tc, CK]`` (``Tc <= cfg.max_tokens_per_rank``, CK >= 1) on ``device``
    (made contiguous), ``count_experts`` a positive multiple of the group size with at most ``cfg.count_columns``
    experts per rank. (Four torch attribute reads: a dispatch's host path.) With ``count_weights`` (the routing
    carried with the rows: :func:`check_carry`): ``(count_ids, count_experts, Tc, CK, count_weights, ids dtype)``.

    Raises:
        InputError: naming the value."""
    W = cfg.world_size
    if (not isinstance(count_experts, int) or isinstance(count_experts, bool) or count_experts < 1
            or count_experts % W):
        raise InputError(f"count_experts={count_experts!r} must be a positive multiple of the group size {W}")
    if count_experts // W > cfg.count_columns:
        raise InputError(f"count_experts={count_experts} gives {count_experts // W} local experts per rank, more "
                         f"than the buffer's count_columns={cfg.count_columns}")
    if not isinstance(count_ids, torch.Tensor):
        raise InputError(f"count_ids must be a 2-D int32 / int64 tensor, got {type(count_ids).__name__}")
    shape = count_ids.shape
    if len(shape) != 2 or count_ids.dtype not in _ID_DTYPES:
        raise InputError(f"count_ids must be a 2-D int32 / int64 tensor, got {count_ids.dtype} {tuple(shape)}")
    if shape[0] > cfg.max_tokens_per_rank or shape[1] < 1:
        raise InputError(f"count_ids must be [<= max_tokens_per_rank={cfg.max_tokens_per_rank}, >= 1], got "
                         f"{tuple(shape)}")
    if count_ids.device != device:
        raise InputError(f"count_ids is on {count_ids.device}, the buffer on {device}")
    cid = count_ids if count_ids.is_contiguous() else count_ids.contiguous()
    if count_weights is None:
        return cid, count_experts, shape[0], shape[1]
    return cid, count_experts, shape[0], shape[1], check_carry(count_weights, cfg, device, carries, T, shape,
                                                               count_experts), count_ids.dtype


def check_carry(count_weights, cfg, device, carries, T, shape, count_experts=0):
    """``count_weights`` of a count routing carried with the rows (:meth:`tritonep.EPBuffer.dispatch`'s
    ``count_weights``), checked and made contiguous: a buffer that carries them (``carries``), ``count_ids`` of
    ``shape = [T, CK]`` (the tokens' own: ``T`` rows, ``CK <= cfg.count_topk``), ``count_weights`` float32 ``[T,
    CK]`` on ``device``, ``count_experts`` below ``2**20`` (the count stamp holds it beside the width). (Four torch
    calls.)

    Raises:
        InputError: naming the value."""
    if not carries:
        raise InputError("count_weights: this buffer does not carry a count routing with its rows (it needs "
                         "count_topk > 0 and the triton backend's one-launch decode tiles)")
    if count_experts >= 1 << 20:
        raise InputError(f"carried count_ids: count_experts={count_experts} must be below 2**20 (it rides in the "
                         f"count stamp beside the carried width)")
    if shape[0] != T or shape[1] > cfg.count_topk:
        raise InputError(f"carried count_ids must be [T={T}, <= count_topk={cfg.count_topk}], got {tuple(shape)}")
    if (not isinstance(count_weights, torch.Tensor) or count_weights.dtype != torch.float32
            or tuple(count_weights.shape) != tuple(shape) or count_weights.device != device):
        raise InputError(f"count_weights must be float32 {tuple(shape)} on {device}, got "
                         f"{_describe(count_weights)}")
    return count_weights if count_weights.is_contiguous() else count_weights.contiguous()


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}"


def check_combine_inputs(expert_out, handle, hidden, dtype, device, min_rows, name="expert_out"):
    """Validate combine inputs (and the ``[rows, H]`` gradients of the backward halves); returns ``expert_out``
    contiguous. ``name`` is the argument the messages name. Cheap (attributes only) like
    :func:`check_dispatch_inputs`.

    Raises:
        InputError: wrong dtype/device/shape, or fewer rows than the dispatch produced.
    """
    if not isinstance(expert_out, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(expert_out).__name__}")
    if expert_out.device != device:
        raise InputError(f"{name} is on {expert_out.device}, the buffer is on {device}")
    if expert_out.dtype != dtype:
        raise InputError(f"{name} must be {dtype}, got {expert_out.dtype}")
    s = expert_out.shape
    if len(s) != 2 or s[1] != hidden:
        raise InputError(f"{name} must have shape [rows, hidden={hidden}], got {tuple(s)}")
    if s[0] < min_rows:
        raise InputError(f"{name} has {s[0]} rows but the dispatch produced {min_rows}")
    return expert_out if expert_out.is_contiguous() else expert_out.contiguous()


def check_backward_inputs(grad, handle, *, hidden, dtype, device, min_rows, grad_w=None, name="grad_y"):
    """Validate the inputs of :meth:`tritonep.EPBuffer.combine_backward` (``grad`` = ``grad_y [T, H]``, ``name``
    ``"grad_y"``) or :meth:`~tritonep.EPBuffer.dispatch_backward` (``grad`` = ``grad_recv_x [rows, H]``, ``name``
    ``"grad_recv_x"``, and ``grad_w``: None or float32 ``[rows]``); returns ``(grad, grad_w)`` contiguous.

    Raises:
        InputError: wrong type, dtype, device or shape (``grad_y`` must have ``handle.num_tokens`` rows, the row
            gradients at least ``min_rows``), naming the argument and the value.
    """
    if name == "grad_y":
        grad = check_combine_inputs(grad, handle, hidden=hidden, dtype=dtype, device=device, min_rows=0, name=name)
        if grad.shape[0] != handle.num_tokens:
            raise InputError(f"grad_y must have shape [num_tokens={handle.num_tokens}, hidden={hidden}], got "
                             f"{tuple(grad.shape)}")
        return grad, None
    grad = check_combine_inputs(grad, handle, hidden=hidden, dtype=dtype, device=device, min_rows=min_rows,
                                name=name)
    if grad_w is not None:
        if not isinstance(grad_w, torch.Tensor) or grad_w.device != device or grad_w.dtype != torch.float32 \
                or grad_w.dim() != 1 or grad_w.shape[0] < min_rows:
            raise InputError(f"grad_recv_w must be a float32 [rows >= {min_rows}] tensor on {device}, got "
                             f"{tuple(getattr(grad_w, 'shape', ()))} {getattr(grad_w, 'dtype', type(grad_w))} on "
                             f"{getattr(grad_w, 'device', None)}")
        if not grad_w.is_contiguous():
            grad_w = grad_w.contiguous()
    return grad, grad_w


