"""DeepEP's V1 Python API (``deep_ep``) on tritonep: code written for DeepEP runs on tritonep's EPBuffers.

One line makes ``import deep_ep`` / ``from deep_ep import Buffer`` / ``from deep_ep.utils import EventOverlap``
resolve here, before the framework imports DeepEP::

    import tritonep.compat.deep_ep; tritonep.compat.deep_ep.install()

Names: :class:`Buffer`, :class:`Config`, :class:`EventOverlap`, :class:`EventHandle`, ``topk_idx_t`` (torch.int64)
and the submodule :mod:`utils`. docs/deep_ep.md maps every DeepEP call to tritonep's, says what differs and what is
not offered. Importing this package imports no kernel module (the EPBuffers are made on first use).
"""

from __future__ import annotations

import sys

import torch

from . import utils
from .buffer import DEFAULTS, Buffer
from .config import Config, get_low_latency_rdma_size_hint
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "utils", "install",
           "get_low_latency_rdma_size_hint"]

topk_idx_t = torch.int64
"""DeepEP's ``topk_idx`` dtype (``deep_ep.topk_idx_t``); int32 ids are accepted too."""


def install(**defaults) -> None:
    """Make ``deep_ep`` and ``deep_ep.utils`` this package (``sys.modules``), so that frameworks importing DeepEP get
    tritonep's Buffer; call it before the framework imports ``deep_ep``.

    Args:
        **defaults: tritonep's Buffer arguments for Buffers made by callers that only pass DeepEP's: ``backend``
            (``"auto"`` | ``"triton"`` | ``"nccl"``), ``max_tokens_per_rank``, ``num_sms``, ``device``,
            ``timeout_s``, ``meta_rows_max_tokens`` (see :class:`Buffer`).

    Raises:
        tritonep.errors.ConfigError: an unknown default.
    """
    unknown = sorted(set(defaults) - set(DEFAULTS))
    if unknown:
        from ...errors import ConfigError

        raise ConfigError(f"install(): unknown defaults {unknown}; known: {sorted(DEFAULTS)}")
    DEFAULTS.update(defaults)
    me = sys.modules[__name__]
    sys.modules["deep_ep"] = me
    sys.modules["deep_ep.utils"] = utils
