"""Cached kernel launches: skip Triton's per-call bookkeeping once a variant is compiled (GPU, eager calls).

``kernel[grid](*args, **kw)`` in Triton 3.6 binds and specialises every argument, builds a cache key from the whole
specialisation, checks every global the kernel read, then launches; with the 30-55 arguments of our protocol kernels
that costs 30-100 us of host time per launch on the H200 (benchmarks/results/eager_profile_*), which is most of an
eager decode call. :class:`LaunchCache` keys a launch on exactly what Triton specialises on (per argument: tensor
dtype and 16-byte alignment; int ``== 1``, ``% 16 == 0`` and its type: i32, i64 or u64 (from 2**63); the value of
constexpr, bool and None arguments; the compile options such as ``num_warps``) and, on a hit, calls the compiled
kernel directly (``CompiledKernel[grid](*bound_args)``, Triton's own launcher) with the arguments bound in parameter
order with their defaults. A miss goes through ``kernel[grid]`` (which compiles if needed) and records the compiled
kernel. Keys are conservative (a superset of Triton's specialisation), so a hit always launches the same binary
Triton would have chosen. Graph capture is unaffected: the launch goes to the current stream either way.

Idea: the "cache the CompiledKernel and call it directly" pattern that serving stacks use to cut Triton launch
latency; the key rules follow ``triton.runtime.jit.create_function_from_signature`` / ``specialize_impl``.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["LaunchCache", "spec_key", "bind_args", "grid3"]

_INT32 = (-(1 << 31), 1 << 31)
_U64_MIN = 1 << 63  # Triton types an int argument >= 2**63 as u64, a smaller one outside int32 as i64


def _arg_key(v):
    """What Triton specialises on for one argument value (a conservative superset)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return ("i", v == 1, v % 16 == 0, _INT32[0] <= v < _INT32[1], v >= _U64_MIN)
    if isinstance(v, float):
        return "f"
    return v  # constexpr values (ints are handled above), dtypes, JIT functions, strings


class _KernelInfo:
    """Parameter names, defaults and constexpr flags of one JIT kernel (computed once)."""

    __slots__ = ("names", "defaults", "nameset", "constexpr", "runtime_names")

    def __init__(self, kernel):
        self.names = [p.name for p in kernel.params]
        self.defaults = [p.default for p in kernel.params]
        self.nameset = frozenset(self.names)
        self.constexpr = [bool(getattr(p, "is_constexpr", False)) for p in kernel.params]
        self.runtime_names = frozenset(n for n, c in zip(self.names, self.constexpr) if not c)


def spec_key(info: _KernelInfo, args: tuple, kwargs: dict) -> tuple:
    """Hashable key of a launch's arguments (see the module docstring).

    Runtime parameters contribute what Triton specialises on (:func:`_arg_key`); constexpr parameters and compile
    options (``num_warps``, ``num_stages``, ...) contribute their exact values.

    Raises:
        TypeError: an unhashable constexpr / option value (the caller falls back to Triton's path).
    """
    pos = tuple(a if c else _arg_key(a) for a, c in zip(args, info.constexpr))
    kw = tuple(sorted((k, _arg_key(v) if k in info.runtime_names else v) for k, v in kwargs.items()))
    return pos, kw


def bind_args(info: _KernelInfo, args: tuple, kwargs: dict) -> list | None:
    """Every parameter's value in order (positional, then keywords, then defaults); None when one is missing."""
    vals = list(args)
    for name, default in zip(info.names[len(args):], info.defaults[len(args):]):
        if name in kwargs:
            vals.append(kwargs[name])
        elif default is inspect.Parameter.empty:
            return None
        else:
            vals.append(default)
    return vals


def grid3(grid: tuple) -> tuple:
    """A launch grid padded to three dimensions with 1 (what ``CompiledKernel[grid]`` indexes)."""
    return tuple(grid) + (1,) * (3 - len(grid))


class LaunchCache:
    """Per-owner cache ``(kernel, grid, spec_key) -> CompiledKernel`` (see the module docstring).

    ``hits`` / ``misses`` count the launches served each way (benchmarks and tests read them).
    """

    def __init__(self):
        self._compiled: dict = {}
        self._info: dict = {}
        self.hits = 0
        self.misses = 0

    def launch(self, kernel, grid: tuple, args: tuple, kwargs: dict):
        """Launch ``kernel[grid](*args, **kwargs)`` on the current stream, directly when the variant is cached."""
        info = self._info.get(kernel)
        if info is None:
            if not hasattr(kernel, "params"):  # not a JIT function: Triton's own path
                return kernel[grid](*args, **kwargs)
            info = self._info[kernel] = _KernelInfo(kernel)
        try:
            key = (kernel, grid, spec_key(info, args, kwargs))
            hash(key)
        except TypeError:  # an unhashable argument: Triton's own path
            return kernel[grid](*args, **kwargs)
        compiled = self._compiled.get(key)
        if compiled is not None:
            vals = bind_args(info, args, {k: v for k, v in kwargs.items() if k in info.nameset})
            if vals is not None:
                self.hits += 1
                compiled[grid3(grid)](*vals)  # Triton's runner indexes grid[0..2]
                return compiled
        self.misses += 1
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "function"):
            self._compiled[key] = compiled
        return compiled
