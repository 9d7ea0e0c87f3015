"""The symmetric regions of one triton-backend EPBuffer (one allocation per buffer; also ``required_bytes``) and
the views of them its kernels are bound to (:class:`RegionViews`).

Flag rows, call counters and the status word are laid out as :mod:`tritonep.device.protocol` names them.
"""

from __future__ import annotations

import torch
import triton

from ...device import protocol as P
from ...memory import Region

__all__ = ["regions", "RegionViews"]


def regions(cfg):
    """The symmetric regions of one EPBuffer of config ``cfg`` (:class:`tritonep.ep.config.EPConfig`); rank-local
    scratch lives in the same allocation."""
    W, E, H, Tm, K = cfg.world_size, cfg.num_experts, cfg.hidden, cfg.max_tokens_per_rank, cfg.topk
    max_recv_tokens, dtype = cfg.max_recv_tokens, cfg.dtype
    ncmax = max(1, triton.cdiv(Tm, cfg.tiles.bt))
    # the count routing's second count matrix (cfg.count_columns, docs in kernels/decode_dispatch.py): two [W, C + 1]
    # matrices for alternate exchanges, row s = what source s counted for this rank, then (column C) source s's count
    # stamp of the call (count_experts, 0 without count_ids: the ranks must agree); only when asked for
    extra = [Region("xcounts", (2, W, cfg.count_columns + 1), torch.int32)] if cfg.count_columns else []
    # the carried top-k (cfg.count_topk, kernels/carry.py): per (source, token) its ids, then its weights' bits; the
    # one-launch decode dispatch carries it, so only its tiles have the region
    if cfg.count_topk and cfg.tiles.decode:
        extra.append(Region("carry", (W, Tm, 2 * cfg.count_topk), torch.int32))
    return extra + [
        Region("flags", (P.v(P.NUM_FLAG_ROWS), W), torch.int64),
        Region("status", (16,), torch.int64),  # the status word (device/protocol.py ST_*), then rows received
        Region("calls", (P.v(P.NUM_CALLS),), torch.int64),
        Region("cbad", (W,), torch.int64),  # the combine number each rank took part in as refused (protocol.py)
        # two [W, E+1] matrices for alternate calls (exchange_kernel DOUBLE); column E: the source's input errors
        Region("counts", (2, W, E + 1), torch.int32),
        Region("ntok", (W,), torch.int32),
        Region("meta", (W, Tm, K), torch.int32),
        Region("wts", (W, Tm, K), torch.float32),
        Region("wback", (W, Tm, K), torch.float32),
        Region("hist", (ncmax, E + 1), torch.int32),
        Region("pre", (ncmax, E), torch.int32),
        Region("send_base", (E,), torch.int32),
        Region("rows_needed", (W,), torch.int64),
        Region("cflag", (W, ncmax), torch.int64),  # per-(source, chunk) arrival epochs of the fused dispatch
        # per-(chunk, expert rank) arrival epochs of the fused combine: one row per token, so any combine tile
        # (KernelTiles.cbt, which may differ from bt and from rank to rank's table only through the static config) fits
        Region("ccflag", (Tm, W), torch.int64),
        # one wire row per (source, token): 2H bytes hold a bf16 row and any quantized row (fp8 H + H/32,
        # mxfp4 H/2 + H/32 bytes); backward passes always move bf16 through the same regions
        Region("stage", (W, Tm, 2 * H), torch.uint8),
        Region("cstage", (W, Tm, 2 * H), torch.uint8),
        Region("expert_out", (max_recv_tokens, H), dtype),
    ]


class RegionViews:
    """The views of one buffer's symmetric allocation ``buf`` (a :mod:`tritonep.memory` allocation of
    :func:`regions`) that its launches are bound to: this rank's ``flags``, ``status``, ``calls``, ``hist``, ``pre``,
    ``send_base``, ``rows_needed``, any region by :meth:`local`, and every rank's pointer table of the shared regions
    (``tab[name]``)."""

    SHARED = ("flags", "counts", "ntok", "meta", "wts", "wback", "stage", "cstage", "cflag", "ccflag", "cbad")

    def __init__(self, buf):
        self._buf = buf
        self.flags, self.status, self.calls = buf.local("flags"), buf.local("status"), buf.local("calls")
        self.hist, self.pre = buf.local("hist"), buf.local("pre")
        self.send_base, self.rows_needed = buf.local("send_base"), buf.local("rows_needed")
        self.tab = {n: buf.ptr_table(n) for n in self.SHARED}
        self.xcounts = None  # the second count matrix (EPConfig.count_columns), when the buffer has one
        if "xcounts" in buf.layout.offsets:
            self.xcounts = buf.local("xcounts")
            self.tab["xcounts"] = buf.ptr_table("xcounts")
        self.carry = None  # the carried top-k's region (EPConfig.count_topk), when the buffer has one
        if "carry" in buf.layout.offsets:
            self.carry = buf.local("carry")
            self.tab["carry"] = buf.ptr_table("carry")

    def local(self, name: str):
        """This rank's view of region ``name``."""
        return self._buf.local(name)
