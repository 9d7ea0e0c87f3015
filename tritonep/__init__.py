"""tritonep: expert-parallel MoE dispatch / combine and virtual-expert load balancing in Python + Triton.

Public API (DESIGN.md §4): :class:`EPBuffer`, :class:`Dispatched`, :class:`DispatchHandle`, :func:`dispatch`,
:func:`combine`, the MoE layer (:class:`MoELayer`, :class:`MoERecipe`, :class:`MoEGeometry`), the planner
(:mod:`tritonep.balance`), the typed errors (:mod:`tritonep.errors`) and the test worlds (:mod:`tritonep.testing`).
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # Without a GPU the kernels can only run in Triton's interpreter, and Triton reads the flag when a kernel is
    # decorated (at import): set it before any kernel module is imported (TRITON_INTERPRET=0 still wins).
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from . import errors  # noqa: E402
from .errors import CapacityError, ConfigError, InputError, PeerInputError, PeerTimeoutError, TimeoutError, TritonEPError  # noqa: E402
from .ep import Dispatched, DispatchHandle, EPBuffer, combine, dispatch  # noqa: E402
from . import balance  # noqa: E402
from .moe import MoEGeometry, MoELayer, MoERecipe  # noqa: E402

__version__ = "0.1.0"

__all__ = ["EPBuffer", "Dispatched", "DispatchHandle", "dispatch", "combine", "MoELayer", "MoERecipe", "MoEGeometry",
           "balance", "errors", "TritonEPError",
           "CapacityError", "ConfigError", "InputError", "PeerInputError", "PeerTimeoutError", "TimeoutError", "__version__"]
