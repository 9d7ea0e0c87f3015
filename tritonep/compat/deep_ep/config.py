"""``deep_ep.Config`` and DeepEP's buffer-size hints, as numbers only.

DeepEP sizes one NVLink buffer (and one RDMA buffer) in bytes from a :class:`Config` (SMs and per-channel chunk
sizes of its ring-buffer kernels) and asks its callers to pass those bytes to ``Buffer(group, num_nvl_bytes,
num_rdma_bytes)``. tritonep's compat Buffer sizes its symmetric memory from the calls themselves (hidden, top-k,
experts and tokens per rank, :meth:`tritonep.EPBuffer.required_bytes`), so these numbers have no effect here; they are
reproduced so that callers that compute them (Megatron-LM's ``get_buffer``, vLLM's and SGLang's buffer factories)
get the values they expect. Formulas: DeepEP ``csrc/config.hpp`` (V1 API: ``Config``, ``get_nvl_buffer_size_hint``,
``get_rdma_buffer_size_hint``, ``LowLatencyLayout``), written anew.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError

__all__ = ["Config", "get_low_latency_rdma_size_hint", "dispatch_config", "combine_config", "NUM_MAX_NVL_PEERS"]

NUM_MAX_NVL_PEERS = 8
"""Ranks of one NVLink domain in DeepEP's V1 kernels (its size hints split a group into NVLink and RDMA ranks)."""

_MAX_TOPK = 128      # DeepEP's sizing assumptions: top-k slots and scales per token it reserves room for
_MAX_SCALES = 128
_SOURCE_META_BYTES = 8   # DeepEP internode SourceMeta: two int32
_ALIGN = 128


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Config:
    """DeepEP's per-call performance config (ignored by tritonep's kernels; their grids come from the backend's kernel
    tiles, ``EPBuffer.tiles``). Positional and keyword arguments as DeepEP's ``Config(num_sms=20,
    num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
    num_max_rdma_chunked_recv_tokens=256)``; ``num_max_rdma_chunked_recv_tokens`` is rounded up to a multiple of the
    send chunk, as DeepEP does.

    Raises:
        ConfigError: the values DeepEP refuses (negative SMs, non-positive chunks, a send chunk not below its receive
            chunk, an RDMA send chunk above half the receive chunk), naming the value.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"Config.{name} must be an int, got {v!r}")
        if self.num_sms < 0:
            raise ConfigError(f"Config.num_sms={self.num_sms} must be >= 0")
        ns, nr = self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens
        if ns <= 0 or nr <= 0 or ns >= nr:
            raise ConfigError(f"Config: need 0 < num_max_nvl_chunked_send_tokens={ns} < "
                              f"num_max_nvl_chunked_recv_tokens={nr}")
        rs, rr = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        if rs <= 0 or rr <= 0:
            raise ConfigError(f"Config: RDMA chunks must be positive, got send={rs} recv={rr}")
        rr = self.num_max_rdma_chunked_recv_tokens = _round_up(rr, rs)
        if not (rs < rr and rs <= rr // 2):
            raise ConfigError(f"Config: need num_max_rdma_chunked_send_tokens={rs} <= "
                              f"num_max_rdma_chunked_recv_tokens/2 (recv {rr} after rounding up to the send chunk)")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for rows of ``hidden_bytes`` bytes in a group of ``num_ranks`` (a multiple of
        128 bytes). No effect on tritonep.

        Raises:
            ConfigError: ``num_ranks`` above 8 and not a multiple of 8, or above 8 with an odd ``num_sms``.
        """
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise ConfigError(f"num_ranks={num_ranks}: DeepEP's sizing needs < 8 or a multiple of 8")
        if num_ranks > NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ConfigError(f"num_sms={self.num_sms} must be even for num_ranks={num_ranks} > 8")
        rdma = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl
        tokens = slots * self.num_max_nvl_chunked_recv_tokens
        per_token = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4
        return _round_up(slots * (2 * rdma + 3) * 4 + tokens * per_token, _ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes (0 for a group within one NVLink domain, ``num_ranks <= 8``). No effect on
        tritonep: groups that span hosts use the nccl backend, which needs no symmetric memory.

        Raises:
            ConfigError: ``num_ranks`` above 8 and not a multiple of 8, or an odd ``num_sms``.
        """
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS or self.num_sms % 2:
            raise ConfigError(f"num_ranks={num_ranks} / num_sms={self.num_sms}: DeepEP's RDMA sizing needs a "
                              f"multiple of 8 ranks and an even SM count")
        rdma = num_ranks // NUM_MAX_NVL_PEERS
        slots = (self.num_sms // 2) * rdma
        tokens = slots * self.num_max_rdma_chunked_recv_tokens
        per_token = 2 * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4 + 16)
        return _round_up(slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + tokens * per_token, _ALIGN)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """DeepEP's low-latency RDMA buffer bytes (two send, two receive and two signal buffers of its double-buffered
    layout; bf16 sizing). No effect on tritonep.

    Raises:
        ConfigError: ``hidden`` not a positive multiple of 128 (DeepEP's per-128 scale layout).
    """
    if not isinstance(hidden, int) or hidden <= 0 or hidden % 128:
        raise ConfigError(f"hidden={hidden!r} must be a positive multiple of 128")
    M, E, S = num_max_dispatch_tokens_per_rank, num_experts, hidden // 128
    dispatch_msg = 16 + max(2 * hidden, hidden + 4 * S)
    combine_msg = 4 * S + 2 * hidden
    send = max(M * dispatch_msg, E * M * combine_msg)
    recv = max(E * M * dispatch_msg, E * M * combine_msg)
    signal = _round_up(E * 4, _ALIGN)
    total = 2 * (send + recv + signal)
    return (total + _ALIGN) // _ALIGN * _ALIGN  # DeepEP adds one alignment unit even when already aligned


# DeepEP's recommended configs per group size: (nvl send, nvl recv, rdma send, rdma recv) chunk tokens
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _pick(table: dict, num_sms: int, num_ranks: int) -> Config:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ConfigError(f"num_ranks={num_ranks!r} must be a positive int")
    key = min((k for k in table if k >= num_ranks), default=max(table))
    return Config(num_sms, *table[key])


def dispatch_config(num_sms: int, num_ranks: int) -> Config:
    """DeepEP's recommended dispatch :class:`Config` for ``num_ranks`` (its table covers 2, 4, 8, 16, ..., 160; other
    sizes get the entry of the next larger size, where DeepEP refuses them: these configs have no effect here)."""
    return _pick(_DISPATCH, num_sms, num_ranks)


def combine_config(num_sms: int, num_ranks: int) -> Config:
    """DeepEP's recommended combine :class:`Config` (see :func:`dispatch_config`)."""
    return _pick(_COMBINE, num_sms, num_ranks)
