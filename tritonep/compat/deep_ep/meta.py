"""The host side of the compat Buffer's two local ops (:class:`MetaOps`): DeepEP's dispatch layout and the unpacking
of the meta lane's rows, each ONE launch of its kernel in :mod:`tritonep.compat.deep_ep.kernels.meta`, bound through
the launch runtime (:class:`tritonep.runtime.launch.Launch`: every launch bound once per variant, then called with
its per-call values only; on the GPU the compiled variant's C entry, on a CPU Triton's interpreter).

Their torch twins (the specification, bit-exact: integer work and moves only) are
:func:`tritonep.compat.deep_ep.packing.layout_torch` and :func:`tritonep.compat.deep_ep.packing.unpack_meta`. Both
kernels are local (no peer access, no signal): their launches are not recorded by the protocol recorder and their grid
may follow this rank's data (docs/protocols.md, host protocol rule).
"""

from __future__ import annotations

import torch
import triton

from ...runtime.launch import Launch
from .kernels.meta import layout_kernel, unpack_meta_kernel

__all__ = ["MetaOps"]


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


class MetaOps:
    """The layout and meta-unpacking launches of one device (module docstring).

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
