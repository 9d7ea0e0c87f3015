"""Kernel launches for multi-rank protocols: no host collective inside a call, variants compiled at construction.

The host protocol rule (docs/protocols.md, "Host protocol rule"): every rank runs the same sequence of host
collectives and signalling kernel launches for a call, whatever its data. A launcher that compiled a variant lazily
and then barriered would break it: a variant first seen by one rank (a data-dependent constexpr, or a kernel
launched only when a rank holds some expert) puts a host barrier on that rank alone, while a kernel on the other
rank waits for a signal (a deadlock, seen on the H200). So:

* :meth:`Launcher.__call__` only launches (no barrier, no sync, no per-launch key building). A variant that was not
  compiled before compiles on first use on that rank alone, which is harmless: waits are bounded by
  ``timeout_s`` (default 300 s) and a compile takes seconds.
* :meth:`Launcher.precompile` runs a code path of the owner with every launch replaced by ``kernel.warmup`` (GPU
  only; the interpreter has nothing to compile), so constructors compile every variant they can launch before the
  one construction-time barrier they already do.
* On the GPU a launch whose variant was compiled before goes straight to the compiled kernel
  (:class:`tritonep.runtime.fast_launch.LaunchCache`, ``TRITONEP_FAST_LAUNCH``), skipping Triton's per-call
  bookkeeping (30-100 us of host time per launch measured on the H200).
* Every launch is reported to the process-wide recorder if one is installed (:func:`set_recorder`): the CPU world
  (:mod:`tritonep.testing.world`) installs one in every rank and fails the test when the ranks' sequences of
  (launch or collective, name, grid) differ.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from . import recorder as _rec

__all__ = ["Launcher", "kernel_name"]


def kernel_name(kernel) -> str:
    """``kernel.fn.__name__`` for a Triton JIT / interpreted function, else its repr."""
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", None) or repr(kernel)


class Launcher:
    """``launcher(kernel, grid, *args, **kwargs)`` launches ``kernel[grid](*args, **kwargs)`` (see module docstring).

    Args:
        device: the owner's device; precompiling happens only on CUDA.
        group: the EP group (kept for the owner; the launcher itself runs no collective).

    Raises:
        ConfigError: a launch whose grid exceeds ``TRITONEP_MAX_PROGRAMS`` (read at construction); the kernels
            were built for another device (CPU tensors without ``TRITON_INTERPRET=1`` when the
            kernels were imported, or the reverse); see :func:`tritonep.device.common.check_kernel_mode`.
    """

    def __init__(self, device: torch.device, group=None):
        from ..device.common import check_kernel_mode

        from .. import envs
        from .fast_launch import LaunchCache

        self.device = torch.device(device)
        check_kernel_mode(self.device.type)  # ConfigError before any launch: kernels built for another device
        if self.device.type == "cpu":  # the interpreter without its per-call member scan (same patches)
            from .interpreter_speed import install

            install()
        self.group = group
        self._warmup = False
        self.cache = LaunchCache() if (self.device.type == "cuda" and envs.fast_launch()) else None
        self.max_programs = envs.max_programs()  # ranks that share a GPU under MPS (docs/platform.md)

    def __call__(self, kernel, grid, *args, **kwargs):
        if self.max_programs and grid[0] > self.max_programs:
            from ..errors import ConfigError

            raise ConfigError(f"{kernel_name(kernel)}: grid {tuple(grid)} exceeds TRITONEP_MAX_PROGRAMS="
                              f"{self.max_programs} (a waiting kernel larger than its share of the GPU can starve "
                              f"a peer that shares it)")
        if self._warmup:
            kernel.warmup(*args, grid=grid, **kwargs)
            return None
        if _rec._RECORDER is not None:
            _rec._RECORDER(("launch", kernel_name(kernel), tuple(grid)))
        if self.cache is not None:
            return self.cache.launch(kernel, tuple(grid), args, kwargs)
        return kernel[grid](*args, **kwargs)

    @property
    def warming(self) -> bool:
        """True while :meth:`precompile` runs (launches compile instead of running)."""
        return self._warmup

    @contextmanager
    def precompile(self):
        """``with launcher.precompile(): <owner code path>``: every launch inside compiles instead of running.

        On CPU (interpreter) the body is skipped entirely: there is nothing to compile, and the body must not run
        (its launches would execute). Owners must undo any device-state change their code path makes outside
        kernels (e.g. call counters advanced with torch ops); :meth:`dry_run` does that for a list of tensors.
        """
        if self.device.type != "cuda":
            yield False
            return
        self._warmup = True
        try:
            yield True
        finally:
            self._warmup = False

    def dry_run(self, fn: Callable[[], object], restore: tuple = ()):
        """Run ``fn()`` under :meth:`precompile` (GPU only) and put back the contents of ``restore`` tensors.

        Returns True when something was compiled (CUDA), False on CPU (``fn`` not called).
        """
        saved = [t.clone() for t in restore] if self.device.type == "cuda" else []
        with self.precompile() as on:
            if on:
                fn()
        for t, s in zip(restore, saved):
            t.copy_(s)
        return self.device.type == "cuda"
