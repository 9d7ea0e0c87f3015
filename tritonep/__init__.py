"""tritonep: expert-parallel MoE dispatch / combine and virtual-expert load balancing in Python + Triton.

Public API (DESIGN.md §4): :class:`EPBuffer`, :class:`Dispatched`, :class:`DispatchHandle`, :func:`dispatch`,
:func:`combine`, the MoE layer (:class:`MoELayer`, :class:`MoERecipe`, :class:`MoEGeometry`), the planner
(:mod:`tritonep.balance`), the typed errors (:mod:`tritonep.errors`) and the test worlds (:mod:`tritonep.testing`).
"""

from . import errors
from .errors import CapacityError, ConfigError, InputError, PeerTimeoutError, TimeoutError, TritonEPError
from .ep import Dispatched, DispatchHandle, EPBuffer, combine, dispatch

__version__ = "0.1.0"

__all__ = ["EPBuffer", "Dispatched", "DispatchHandle", "dispatch", "combine", "errors", "TritonEPError",
           "CapacityError", "ConfigError", "InputError", "PeerTimeoutError", "TimeoutError", "__version__"]
