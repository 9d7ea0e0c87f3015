"""The one launch runtime: every kernel launch of tritonep's backends is bound once and then called with its per-call
values only.

An owner (a backend, a counts exchange, an expert transport) makes ONE :class:`Launch` for its device and binds each
of its kernel launches at construction: :meth:`Launch.bind` returns a :class:`tritonep.runtime.bound.BoundKernel`
(static arguments fixed, the per-call values named, on the GPU the compiled variant's C entry called directly with
the parameters packed once: :mod:`tritonep.runtime.packed_launch`); :meth:`Launch.variant` caches the bound launches
of variants an owner binds on first use (a wire, a combine kind, a tile). There is no other way to launch: a kernel
launched as ``kernel[grid](...)`` outside a bound launch escapes the protocol recorder, and
``tests/testing/test_protocol_recorder.py`` checks on the source that no signalling kernel is.

The host protocol rule (docs/protocols.md, "Host protocol rule"): every rank runs the same sequence of host
collectives and signalling kernel launches for a call, whatever its data. A launch that compiled a variant lazily and
then barriered would break it: a variant first seen by one rank (a data-dependent constexpr, or a kernel launched
only when a rank holds some expert) puts a host barrier on that rank alone, while a kernel on the other rank waits for
a signal (a deadlock, seen on the H200). So:

* a bound launch only launches (no barrier, no sync). A variant that was not compiled before compiles on first use
  on that rank alone, which is harmless: waits are bounded by ``timeout_s`` (default 300 s) and a compile takes
  seconds;
* :meth:`Launch.precompile` / :meth:`Launch.dry_run` run a code path of the owner with every bound launch compiling
  (``kernel.warmup``) instead of running (GPU only; the interpreter has nothing to compile), so constructors compile
  every variant they can launch before their one construction-time barrier, and the compiled variants are bound for
  the direct path at once;
* every launch of a launch runtime made with ``record=True`` (signalling kernels: the triton backend, its counts
  exchange and expert transport) is reported to the process-wide recorder if one is installed
  (:mod:`tritonep.runtime.recorder`): the CPU world (:mod:`tritonep.testing.world`) installs one in every rank and
  fails the test when the ranks' sequences of (launch or collective, name, grid) differ. Local kernels whose grid
  follows this rank's data (the nccl backend's) are bound with ``record=False``: they signal nobody, so a rank may
  skip or resize them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from .bound import BoundKernel

__all__ = ["Launch", "kernel_name"]


def kernel_name(kernel) -> str:
    """``kernel.fn.__name__`` for a Triton JIT / interpreted function, else its repr."""
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", None) or repr(kernel)


class Launch:
    """The launch runtime of one owner (see the module docstring).

    Args:
        device: the owner's device (CUDA: direct launches, precompiling; CPU: Triton's interpreter every launch).
        record: report the launches to the protocol recorder (signalling kernels must; local kernels whose launch
            depends on the rank's data must not).
        max_programs: the cap on a launch's programs (0: none); a larger grid is a ConfigError (at binding for a
            static grid, at the call for a per-call grid). Owners of kernels that wait on a peer pass their
            configuration's (ranks that share a GPU under MPS must fit their waiting programs on the chip together,
            docs/platform.md); local kernels that wait for nobody pass 0.
        mode: how a bound launch reaches the GPU (:data:`tritonep.envs.LAUNCH_MODES`): ``"packed"`` (the variant's
            C entry, parameters packed once), ``"direct"`` (the compiled kernel's C launcher), ``"triton"``
            (``kernel[grid]`` every launch); the CPU always takes Triton's (interpreter) path.

    Raises:
        ConfigError: the kernels were built for another device (CPU tensors without ``TRITON_INTERPRET=1`` when the
            kernels were imported, or the reverse); see :func:`tritonep.device.common.check_kernel_mode`.
    """

    def __init__(self, device, *, record: bool = True, max_programs: int = 0, mode: str = "packed"):
        from ..device.common import check_kernel_mode

        self.device = torch.device(device)
        check_kernel_mode(self.device.type)  # ConfigError before any launch: kernels built for another device
        if self.device.type == "cpu":  # the interpreter without its per-call member scan (same patches)
            from .interpreter_speed import install

            install()
        self.max_programs = max_programs
        self.direct = mode in ("packed", "direct")  # read by BoundKernel: the compiled variant's C entry
        self.packed = mode == "packed"  # ... with its parameters packed once (runtime/packed_launch.py)
        self.record = record
        self._warmup = False
        self._variants: dict = {}

    def bind(self, kernel, static: dict, dyn: tuple = (), *, grid=None, fields: dict | None = None,
             record: bool | None = None) -> BoundKernel:
        """``kernel`` bound with ``static`` (every argument the configuration decides, compile options by name) and
        the per-call parameters ``dyn``, in the order a call passes them; ``grid``: the launch grid when the
        configuration decides it (else None: a call passes its grid first); ``fields``: parameters that are fields
        of one per-call int32 storage block (:class:`tritonep.runtime.bound.BoundKernel`); ``record``: this launch
        runtime's by default.

        Raises:
            TypeError: a parameter neither bound nor per-call and without a default, or an unknown name.
            ConfigError: a static grid beyond ``max_programs``.
        """
        return BoundKernel(self, kernel, grid, static, dyn, record=self.record if record is None else record,
                           fields=fields)

    def variant(self, key, make: Callable[[], BoundKernel]) -> BoundKernel:
        """The bound launch of variant ``key`` (a hashable of what decides its static arguments), made by ``make()``
        on first use and kept."""
        bk = self._variants.get(key)
        if bk is None:
            bk = self._variants[key] = make()
        return bk

    def bound(self, key) -> BoundKernel | None:
        """The bound launch of variant ``key`` if :meth:`variant` made it, else None (a call's fast path: no closure
        built)."""
        return self._variants.get(key)

    @property
    def warming(self) -> bool:
        """True while :meth:`precompile` runs (launches compile instead of running)."""
        return self._warmup

    @contextmanager
    def precompile(self):
        """``with launch.precompile(): <owner code path>``: every bound launch inside compiles instead of running.

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
