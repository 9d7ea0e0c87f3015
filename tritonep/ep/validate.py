"""Front-door checks of every EPBuffer call, run before any peer is touched (shared by all backends).

Policy (documented in README "Guarantees"): a non-contiguous ``x`` / ``expert_out`` is copied to a contiguous
tensor (same values, never wrong data); ``topk_weights`` of another float dtype is converted to float32; everything
else that does not match is refused with :class:`tritonep.errors.InputError` or
:class:`tritonep.errors.CapacityError` naming the value.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError, ConfigError, InputError

__all__ = ["check_dispatch_inputs", "check_combine_inputs", "check_backward_inputs", "check_expert_ids", "check_static",
           "counts_input_refusal", "default_max_recv"]

_ID_DTYPES = (torch.int32, torch.int64)


def check_dispatch_inputs(x, topk_idx, topk_weights, *, hidden, topk, max_tokens_per_rank, dtype, device):
    """Validate dispatch inputs; returns ``(x, topk_idx, topk_weights)`` contiguous, weights float32.

    Raises:
        InputError: wrong type, dtype, device, rank or shape (message names the tensor and the value).
        CapacityError: more tokens than ``max_tokens_per_rank``.
    """
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise InputError(f"{name} is on {t.device}, the buffer is on {device}")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise InputError(f"x must have shape [num_tokens, hidden={hidden}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise InputError(f"x must be {dtype}, got {x.dtype}")
    T = x.shape[0]
    if T > max_tokens_per_rank:
        raise CapacityError(f"num_tokens={T} exceeds max_tokens_per_rank={max_tokens_per_rank}",
                            needed=T, available=max_tokens_per_rank)
    if topk_idx.dtype not in _ID_DTYPES:
        raise InputError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if tuple(topk_idx.shape) != (T, topk):
        raise InputError(f"topk_idx must have shape [num_tokens={T}, topk={topk}], got {tuple(topk_idx.shape)}")
    if tuple(topk_weights.shape) != (T, topk):
        raise InputError(f"topk_weights must have shape [num_tokens={T}, topk={topk}], "
                         f"got {tuple(topk_weights.shape)}")
    if not topk_weights.is_floating_point():
        raise InputError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    return (x.contiguous(), topk_idx.contiguous(),
            topk_weights.to(torch.float32).contiguous())


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int):
    """Host check that every id is in [-1, num_experts) (one device->host read).

    Raises:
        InputError: naming the first offending value and its (token, k) position.
    """
    if topk_idx.numel() == 0:
        return
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        pos = torch.nonzero(bad)[0].tolist()
        val = int(topk_idx[pos[0], pos[1]])
        raise InputError(f"topk_idx[{pos[0]}, {pos[1]}] = {val} is outside [-1, num_experts={num_experts})")


def counts_input_refusal(topk_idx, topk: int, max_tokens_per_rank: int, device):
    """The error a counts exchange refuses ``topk_idx`` with (every backend's), or None when it is accepted.

    Returns:
        InputError: not an int32/int64 ``[T, topk]`` tensor on ``device``. CapacityError: ``T > max_tokens_per_rank``.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[1] != topk \
            or topk_idx.dtype not in (torch.int32, torch.int64) or topk_idx.device != device:
        return InputError(f"topk_idx must be an int32/int64 [T, {topk}] tensor on {device}, got "
                          f"{tuple(getattr(topk_idx, 'shape', ()))} {getattr(topk_idx, 'dtype', type(topk_idx))}")
    if topk_idx.shape[0] > max_tokens_per_rank:
        return CapacityError(f"num_tokens={topk_idx.shape[0]} exceeds max_tokens_per_rank={max_tokens_per_rank}",
                             needed=topk_idx.shape[0], available=max_tokens_per_rank)
    return None


def check_combine_inputs(expert_out, handle, *, hidden, dtype, device, min_rows, name="expert_out"):
    """Validate combine inputs (and the ``[rows, H]`` gradients of the backward halves); returns ``expert_out``
    contiguous. ``name`` is the argument the messages name.

    Raises:
        InputError: wrong dtype/device/shape, or fewer rows than the dispatch produced.
    """
    if not isinstance(expert_out, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(expert_out).__name__}")
    if expert_out.device != device:
        raise InputError(f"{name} is on {expert_out.device}, the buffer is on {device}")
    if expert_out.dtype != dtype:
        raise InputError(f"{name} must be {dtype}, got {expert_out.dtype}")
    if expert_out.dim() != 2 or expert_out.shape[1] != hidden:
        raise InputError(f"{name} must have shape [rows, hidden={hidden}], got {tuple(expert_out.shape)}")
    if expert_out.shape[0] < min_rows:
        raise InputError(f"{name} has {expert_out.shape[0]} rows but the dispatch produced {min_rows}")
    return expert_out.contiguous()


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
        grad_w = grad_w.contiguous()
    return grad, grad_w


def default_max_recv(world_size, num_experts, max_tokens_per_rank, topk, expert_alignment):
    """Rows a rank can receive at most: every route of every rank, plus each local expert's alignment padding."""
    L = num_experts // world_size
    return world_size * max_tokens_per_rank * topk + L * (expert_alignment - 1)


def check_static(world_size, num_experts, hidden, max_tokens_per_rank, topk, dispatch_wire, combine_wire,
                 expert_alignment, max_recv_tokens):
    """Check an EPBuffer's static configuration before anything is allocated (the ``backend=`` name is checked by
    the registry: :func:`tritonep.ep.backends.check_backend_name`).

    Raises:
        ConfigError: a size that is not a positive int, ``num_experts`` not divisible by ``world_size`` or a bad
            ``max_recv_tokens`` (the message names the value).
        WireError: an unknown wire or a ``hidden`` the wire's block does not divide.
    """
    from ..wire.formats import check_wire

    for name, v in (("world_size", world_size), ("num_experts", num_experts), ("hidden", hidden),
                    ("max_tokens_per_rank", max_tokens_per_rank), ("topk", topk),
                    ("expert_alignment", expert_alignment)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    if num_experts % world_size:
        raise ConfigError(f"num_experts={num_experts} is not divisible by world_size={world_size}")
    if max_recv_tokens is not None and (not isinstance(max_recv_tokens, int) or max_recv_tokens < 1):
        raise ConfigError(f"max_recv_tokens must be a positive int or None, got {max_recv_tokens!r}")
    check_wire(dispatch_wire, hidden, "dispatch_wire")
    check_wire(combine_wire, hidden, "combine_wire")
