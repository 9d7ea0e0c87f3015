"""tritonep: expert-parallel MoE dispatch / combine and virtual-expert load balancing in Python + Triton.

Public API (docs/architecture.md): :class:`EPBuffer`, :class:`Dispatched`, :class:`DispatchHandle`, :func:`dispatch`,
:func:`combine`, the MoE layer (:class:`MoELayer`, :class:`MoERecipe`, :class:`MoEGeometry`), the planner
(:mod:`tritonep.balance`), the typed errors (:mod:`tritonep.errors`) and the test worlds (:mod:`tritonep.testing`).

Importing the package has no side effects: it neither reads nor sets the environment and imports no kernel module.
The names above are resolved on first use (PEP 562 module ``__getattr__``). Triton decides between compiled and
interpreted kernels when a kernel module is first imported, so on a machine without a GPU set
``TRITON_INTERPRET=1`` before the first use of :class:`EPBuffer` / :class:`MoELayer` (the ``tritonep`` command,
:func:`tritonep.testing.run_cpu_world` and the test suite do it for you); a CPU buffer built with compiled kernels
raises :class:`ConfigError` saying so (docs/platform.md).
"""

from __future__ import annotations

import importlib as _importlib

from . import errors
from .errors import (CapacityError, ConfigError, CountRoutingError, InputError, PeerConfigError, PeerInputError,
                     PeerTimeoutError, TimeoutError, TritonEPError)

__version__ = "0.1.0"

_LAZY = {
    "EPBuffer": "tritonep.ep", "Dispatched": "tritonep.ep", "DispatchHandle": "tritonep.ep",
    "dispatch": "tritonep.ep", "combine": "tritonep.ep",
    "MoELayer": "tritonep.moe", "MoERecipe": "tritonep.moe", "MoEGeometry": "tritonep.moe",
}
_SUBMODULES = ("balance", "ep", "moe", "wire", "testing", "reference", "memory", "kernels", "data", "bench", "cli")

__all__ = ["EPBuffer", "Dispatched", "DispatchHandle", "dispatch", "combine", "MoELayer", "MoERecipe", "MoEGeometry",
           "balance", "errors", "TritonEPError",
           "CapacityError", "ConfigError", "CountRoutingError", "InputError", "PeerConfigError", "PeerInputError",
           "PeerTimeoutError",
           "TimeoutError",
           "__version__"]


def __getattr__(name: str):
    """Resolve a public name (or a submodule) on first use; raises AttributeError for anything else."""
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return _importlib.import_module(f"tritonep.{name}")
    raise AttributeError(f"module 'tritonep' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
