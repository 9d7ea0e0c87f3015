"""DeepEP's normal mode: the checks of a dispatch's and a combine's arguments (:class:`NormalChecks`, a mixin of
:class:`tritonep.compat.deep_ep.normal.NormalMode`).

The common calls (a dispatch of bf16 ``x`` with top-k, a combine of bf16 rows with or without ``topk_weights``, no
bias) are checked in one expression each (:func:`_plain_dispatch`, :func:`_plain_rows`, :func:`_plain_weights`: every
condition of the checks one by one, no function call per argument); any other call, a refused one included, is
checked one by one (:meth:`NormalChecks._checked`, :meth:`NormalChecks._combine_checked`), which names the refused
value and takes part in the peers' call before raising
(:class:`tritonep.compat.deep_ep.normal_refusal.NormalRefusals`).
"""

from __future__ import annotations

import torch

from ...errors import InputError, TritonEPError
from .packing import pack_quantized

__all__ = ["NormalChecks"]

_ID_DTYPES = (torch.int32, torch.int64)


def _tensor(v, name: str, dims: int, dtypes=None) -> torch.Tensor:
    """``v`` when it is a ``dims``-D tensor (of one of ``dtypes`` when given); else InputError naming ``name``."""
    if not isinstance(v, torch.Tensor) or v.dim() != dims:
        raise InputError(f"{name} must be a {dims}-D torch.Tensor, got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    if dtypes is not None and v.dtype not in dtypes:
        raise InputError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {v.dtype}")
    return v


def _width(x) -> int | None:
    """The row width ``x`` would travel with (None when ``x`` is not a 2-D tensor or an ``(x_q, scales)`` pair whose
    ``x_q`` is one)."""
    t = x[0] if isinstance(x, tuple) and x else x
    return t.shape[1] if isinstance(t, torch.Tensor) and t.dim() == 2 else None


def _plain_dispatch(x, itr, per_rank, per_expert, topk_idx, topk_weights, worst, alignment, W: int):
    """``(x contiguous, T, E, K, device, row width)`` of a fresh dispatch whose arguments pass every check of
    :meth:`NormalChecks._checked` as a bf16 ``x`` with top-k (the common call), tested in one expression; None for any
    other call (quantized ``x``, no top-k, or something to refuse: the checks then run one by one and name it)."""
    Tn = torch.Tensor
    if not (type(worst) is int and worst >= 0 and type(alignment) is int and alignment >= 1 and per_rank is not None
            and isinstance(x, Tn) and isinstance(itr, Tn) and isinstance(per_expert, Tn) and isinstance(topk_idx, Tn)
            and isinstance(topk_weights, Tn)):
        return None
    xs, ks = x.shape, topk_idx.shape
    if len(xs) != 2 or len(ks) != 2 or x.dtype != torch.bfloat16 or itr.dtype != torch.bool or per_expert.dim() != 1:
        return None
    T, K, E = xs[0], ks[1], per_expert.shape[0]
    dev = x.device
    if (itr.shape != (T, W) or E < 1 or E % W or ks[0] != T or topk_idx.dtype not in _ID_DTYPES
            or topk_weights.dtype != torch.float32 or topk_weights.shape != (T, K) or itr.device != dev
            or topk_idx.device != dev or topk_weights.device != dev):
        return None
    return (x if x.is_contiguous() else x.contiguous()), T, E, K, dev, xs[1]


def _plain_rows(x, h) -> bool:
    """Whether a combine's ``x`` is a bf16 tensor of the dispatch's ``[rows, H]`` on its rows' device (handle ``h``):
    every check :meth:`NormalChecks._combine_checked` makes of ``x``, in one expression."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        return False
    lane = h.x_lane
    return x.shape == (h.num_rows, lane.hidden) and x.device == lane.device


def _plain_weights(w, h) -> bool:
    """Whether a combine's ``topk_weights`` is a float32 tensor of the dispatch's ``[rows, K]`` (K its top-k width, 0
    included) on its rows' device (handle ``h``): every check :meth:`NormalChecks._combine_checked` makes of it, in
    one expression."""
    return (isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.shape == (h.num_rows, h.topk)
            and w.device == h.x_lane.device)


class NormalChecks:
    """The argument checks of :class:`tritonep.compat.deep_ep.normal.NormalMode` (see the module docstring); they use
    its ``W`` and its refusal half's ``_refuse`` / ``_cancel_combine``."""

    def _checked(self, x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, topk_idx, topk_weights,
                 worst, expert_alignment, refused, k_part):
        """A fresh dispatch's arguments checked one by one: ``(payload, T, E, K, device, row width, quant, spec)``
        (:meth:`_payload`'s rows and quantization); a refused one (or ``refused``) takes part in the peers' lane and
        raises its typed error (:meth:`_refuse`)."""
        spec = None
        try:
            if refused is not None:
                raise refused
            payload, width, quant = self._payload(x)
            spec = (width, worst, k_part)
            T = payload.shape[0]
            if not isinstance(worst, int) or isinstance(worst, bool) or worst < 0:
                raise InputError(f"num_worst_tokens={worst!r} must be an int >= 0")
            if not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool) or expert_alignment < 1:
                raise InputError(f"expert_alignment={expert_alignment!r} must be a positive int")
            _tensor(is_token_in_rank, "is_token_in_rank", 2, (torch.bool,))
            if tuple(is_token_in_rank.shape) != (T, self.W):
                raise InputError(f"is_token_in_rank must be [num_tokens={T}, num_ranks={self.W}], got "
                                 f"{tuple(is_token_in_rank.shape)}")
            if num_tokens_per_rank is None or num_tokens_per_expert is None:
                raise InputError("dispatch without a handle needs num_tokens_per_rank and num_tokens_per_expert "
                                 "(get_dispatch_layout gives them)")
            _tensor(num_tokens_per_expert, "num_tokens_per_expert", 1)
            E = num_tokens_per_expert.shape[0]
            if E < 1 or E % self.W:
                raise InputError(f"num_tokens_per_expert has {E} experts, not a positive multiple of {self.W}")
            if (topk_idx is None) != (topk_weights is None):
                raise InputError("topk_idx and topk_weights must be given together")
            K = 0
            if topk_idx is not None:
                _tensor(topk_idx, "topk_idx", 2, _ID_DTYPES)
                _tensor(topk_weights, "topk_weights", 2, (torch.float32,))
                K = topk_idx.shape[1]
                if topk_idx.shape[0] != T or tuple(topk_weights.shape) != (T, K):
                    raise InputError(f"topk_idx {tuple(topk_idx.shape)} and topk_weights "
                                     f"{tuple(topk_weights.shape)} must both be [num_tokens={T}, K]")
            elif worst:
                raise InputError("num_worst_tokens needs topk_idx and topk_weights (as DeepEP)")
            dev = payload.device
            if is_token_in_rank.device != dev or K and (topk_idx.device != dev or topk_weights.device != dev):
                for name, t in (("is_token_in_rank", is_token_in_rank), ("topk_idx", topk_idx),
                                ("topk_weights", topk_weights)):
                    if t is not None and t.device != dev:
                        raise InputError(f"{name} is on {t.device}, x on {dev}")
        except TritonEPError as e:
            spec = self._part_spec(x, worst, k_part)
            self._refuse(e, spec, bool(spec[1]), k_part)
        return payload, T, E, K, dev, width, quant, spec

    def _part_spec(self, x, worst, k_part):
        """``(row width, num_worst_tokens, K)`` of the lane a refused dispatch takes part in: each as this call passed
        it where it can be read (the width of a 2-D ``x`` or ``x_q``, a valid ``num_worst_tokens``, ``k_part``: see
        :meth:`_k_part`), else the latest dispatch's (the peers' most likely), else 0 (a fresh Buffer: a width 0
        makes the lane's construction fail on every rank). Not the latest dispatch's alone: a call whose width,
        ``num_worst_tokens`` or K differs from it runs on another lane, and taking part in that one would leave the
        peers waiting (a timeout on every rank)."""
        last = self._last_spec or (0, 0, 0)
        width = _width(x)
        valid = isinstance(worst, int) and not isinstance(worst, bool) and worst >= 0
        return (last[0] if width is None else width, worst if valid else last[1], k_part)

    def _payload(self, x):
        """``x`` -> (bf16 rows to send, their width, None or (x dtype, scale dtype, scales per row))."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise InputError(f"x as a tuple must be (x_fp8, scales), got {len(x)} elements")
            xq, sc = x
            _tensor(xq, "x[0]", 2)
            _tensor(sc, "x[1] (scales)", 2)
            if xq.element_size() != 1:
                raise InputError(f"quantized x must have a one-byte dtype, got {xq.dtype}")
            if sc.element_size() != 4 or sc.shape[0] != xq.shape[0]:
                raise InputError(f"scales must be [num_tokens={xq.shape[0]}, S] of a 4-byte dtype (float32 or "
                                 f"int32 UE8M0), got {sc.dtype} {tuple(sc.shape)}")
            H, S = xq.shape[1], sc.shape[1]
            if H % 2 or 4 * S > H:
                raise InputError(f"quantized rows of {H} elements with {S} scales do not fit a {H}-element bf16 "
                                 f"row (need an even hidden and 4 * scales <= hidden)")
            if sc.device != xq.device:
                raise InputError(f"scales on {sc.device}, x on {xq.device}")
            return pack_quantized(xq, sc), H, (xq.dtype, sc.dtype, S)
        _tensor(x, "x", 2)
        if x.dtype != torch.bfloat16:
            raise InputError(f"x must be bfloat16 (or a (one-byte x, scales) tuple), got {x.dtype}")
        return (x if x.is_contiguous() else x.contiguous()), x.shape[1], None

    def _combine_checked(self, x, h, topk_weights, bias, refused, own: bool) -> list:
        """A combine's arguments checked one by one (``refused``: an error the Buffer found in the others; ``own``:
        whether ``h`` is this Buffer's handle); returns the biases to add. A refused one takes part in the peers'
        combine (:meth:`_cancel_combine`) and raises its typed error."""
        try:
            if refused is not None:
                raise refused
            if not own:
                raise InputError("handle must be a NormalHandle made by this Buffer's dispatch")
            _tensor(x, "x", 2, (torch.bfloat16,))
            if tuple(x.shape) != (h.num_rows, h.x_lane.hidden):
                raise InputError(f"combine: x must be [{h.num_rows}, {h.x_lane.hidden}] (the dispatch's rows), got "
                                 f"{tuple(x.shape)}")
            if topk_weights is not None:
                _tensor(topk_weights, "topk_weights", 2, (torch.float32,))
                K = h.topk
                if tuple(topk_weights.shape) != (h.num_rows, K):  # K = 0: no top-k, or DeepEP's width 0
                    raise InputError(f"combine(topk_weights {tuple(topk_weights.shape)}) needs one weight row of the "
                                     f"dispatch's top-k width per received row: [{h.num_rows}, {K}]")
            biases = ()
            if bias is not None:
                biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
                if isinstance(bias, tuple) and len(bias) != 2:
                    raise InputError(f"bias must be a tensor or a tuple of two, got a tuple of {len(bias)}")
                for b in biases:
                    _tensor(b, "bias", 2, (torch.bfloat16,))
                    if tuple(b.shape) != (h.num_tokens, x.shape[1]):
                        raise InputError(f"bias must be [{h.num_tokens}, {x.shape[1]}], got {tuple(b.shape)}")
            dev = h.x_lane.device
            if biases or x.device != dev or topk_weights is not None and topk_weights.device != dev:
                for name, t in (("x", x), ("topk_weights", topk_weights), *(("bias", b) for b in biases)):
                    if t is not None and t.device != dev:
                        raise InputError(f"combine: {name} is on {t.device}, the dispatch's rows on {dev}")
        except TritonEPError:
            self._cancel_combine(h if own else None, topk_weights is not None)
            raise
        return biases
