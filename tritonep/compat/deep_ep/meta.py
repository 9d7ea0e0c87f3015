"""The host side of the compat Buffer's three local ops (:class:`MetaOps`): DeepEP's dispatch layout and the
unpacking of the meta lane's rows, each ONE launch of its kernel in :mod:`tritonep.compat.deep_ep.kernels.meta`, and
the NaN fill of a ``num_worst_tokens`` call refused for capacity (one launch of
:mod:`tritonep.compat.deep_ep.kernels.poison`), bound through the launch runtime
(:class:`tritonep.runtime.launch.Launch`: every launch bound once per variant, then called with its per-call values
only; on the GPU the compiled variant's C entry, on a CPU Triton's interpreter).

Their torch twins (the specification, bit-exact: integer work and moves only) are
:func:`tritonep.compat.deep_ep.packing.layout_torch`, :func:`tritonep.compat.deep_ep.packing.unpack_meta` and
:func:`tritonep.compat.deep_ep.packing.poison_torch`. The kernels are local (no peer access, no signal): their
launches are not recorded by the protocol recorder and their grid may follow this rank's data (docs/protocols.md,
host protocol rule).
"""

from __future__ import annotations

import torch
import triton

from ...errors import InputError
from ...runtime.launch import Launch
from .kernels.meta import layout_kernel, unpack_meta_kernel
from .kernels.poison import poison_kernel

__all__ = ["MetaOps"]


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous: a reshape of anything else would copy, and the fill would be lost) as a flat integer view
    of its element size.

    Raises:
        InputError: ``t`` not contiguous, or not of 1-, 2- or 4-byte elements."""
    if not t.is_contiguous() or t.element_size() not in _INT:
        raise InputError(f"poison needs contiguous tensors of 1-, 2- or 4-byte elements, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")
    return t.view(_INT[t.element_size()]).view(-1)


class MetaOps:
    """The layout, meta-unpacking and poison launches of one device (module docstring).

    Args:
        device: the device the tensors live on.
        launch: the launch path (:data:`tritonep.envs.LAUNCH_MODES`; the compat Buffer's, read once with its
            options); ignored on a CPU.

    Raises:
        ConfigError: kernels built for another device (:class:`tritonep.runtime.launch.Launch`).
    """

    def __init__(self, device, launch: str = "packed"):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # local kernels: nothing to record, no program cap (they wait for nobody)
        self._launch = Launch(self.device, record=False, max_programs=0, mode=launch)

    def layout(self, topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
        """``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W])`` of
        ``topk_idx [T, K]`` (contiguous int32 / int64, on this device), by one launch of
        :func:`tritonep.compat.deep_ep.kernels.meta.layout_kernel` (grid 1); same values as
        :func:`tritonep.compat.deep_ep.packing.layout_torch` (an id outside ``[0, E)`` selects nothing)."""
        T, K = topk_idx.shape
        dev = topk_idx.device
        in_rank = torch.empty(T, num_ranks, dtype=torch.bool, device=dev)
        per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
        key = ("layout", K, num_experts, num_ranks)
        bk = self._launch.bound(key)
        if bk is None:
            bk = self._launch.variant(key, lambda: self._launch.bind(layout_kernel, dict(
                K=K, KB=_p2(K), E=num_experts, EB=_p2(num_experts), L=num_experts // num_ranks, W=num_ranks,
                WB=_p2(num_ranks), BT=64 if self._cuda else 32, num_warps=8 if self._cuda else 4),
                ("ids_ptr", "T", "in_rank_ptr", "per_rank_ptr", "per_expert_ptr"), grid=(1,)))
        bk(topk_idx, T, in_rank, per_rank, per_expert)
        return per_rank, per_expert, in_rank

    def unpack_meta(self, rows: torch.Tensor, weights: torch.Tensor, num_tokens: int, topk: int, rank: int,
                    num_local_experts: int, idx_dtype: torch.dtype, live: torch.Tensor | None = None):
        """The meta lane's received rows -> ``(recv_topk_idx [R, K] idx_dtype, recv_topk_weights [R, K] float32,
        hist int32 [L + 1])`` for its first ``R = num_tokens`` tokens (``rows``: bf16 ``[>= R*K, width]``,
        contiguous rows; ``weights``: float32 ``[>= R*K]``), by one launch of
        :func:`tritonep.compat.deep_ep.kernels.meta.unpack_meta_kernel` (``cdiv(R, BR)`` programs); ``live``: a
        device int32 scalar, the tokens actually received (rows past it read as not received: ids -1, weight 0, not
        counted). Same values as :func:`tritonep.compat.deep_ep.packing.unpack_meta`."""
        R, K, L = num_tokens, topk, num_local_experts
        dev = rows.device
        idx = torch.empty(R, K, dtype=idx_dtype, device=dev)
        wout = torch.empty(R, K, dtype=torch.float32, device=dev)
        hist = torch.zeros(L + 1, dtype=torch.int32, device=dev)
        if R:
            br = 128 if self._cuda else 64
            has_live = live is not None
            key = ("unpack_meta", K, L, has_live)
            bk = self._launch.bound(key)
            if bk is None:
                bk = self._launch.variant(key, lambda: self._launch.bind(unpack_meta_kernel, dict(
                    K=K, KB=_p2(K), L=L, BR=br, LIVE=has_live),
                    ("rows_ptr", "RS", "w_ptr", "R", "live_ptr", "lo", "idx_ptr", "wout_ptr", "hist_ptr")))
            r32 = rows.view(torch.int32)
            bk((triton.cdiv(R, br),), r32, r32.stride(0), weights, R, live if has_live else hist, rank * L, idx,
               wout, hist)
        return idx, wout, hist

    def poison(self, counts: torch.Tensor, limit: int, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
        """Fill ``a`` (and ``b``) with NaN bits in place when some column of ``counts`` (int32 ``[W, W]``, this
        device) sums to more than ``limit``; no host read. ``a`` / ``b``: contiguous tensors of 1-, 2- or 4-byte
        elements on this device. One launch of :func:`tritonep.compat.deep_ep.kernels.poison.poison_kernel`
        (``min(cdiv(n, BLOCK), 132)`` programs on a GPU, 1 on a CPU); same bits as
        :func:`tritonep.compat.deep_ep.packing.poison_torch`.

        Raises:
            InputError: ``a`` or ``b`` not contiguous, or of another element size (before the launch)."""
        W = counts.shape[0]
        av = _bits(a)
        bv = _bits(b) if b is not None else av[:0]
        n = max(av.numel(), bv.numel())
        block = 1024 if self._cuda else 4096
        grid = min(max(triton.cdiv(n, block), 1), 132) if self._cuda else 1
        key = ("poison", W, block)
        bk = self._launch.bound(key)
        if bk is None:
            bk = self._launch.variant(key, lambda: self._launch.bind(poison_kernel, dict(
                W=W, WB=_p2(W), BLOCK=block, num_warps=4),
                ("counts_ptr", "cs0", "cs1", "limit", "a_ptr", "NA", "b_ptr", "NB", "nprog")))
        bk((grid,), counts, counts.stride(0), counts.stride(1), int(limit), av, av.numel(), bv, bv.numel(), grid)
