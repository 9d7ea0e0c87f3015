"""Kernel launches bound once per buffer: every static argument fixed at construction, a call fills a few slots.

A :class:`BoundKernel` is one kernel of one buffer's call path (e.g. the dispatch's send kernel) with its compile
options, every argument the static configuration decides (region views, pointer tables, tiles, ranks, wires) and,
where the configuration decides it, its grid filled in at construction. A call passes only the per-call values
(input tensors, this call's handle storage, T), in a fixed order (``dyn``); a kernel whose grid follows this call's
data (the nccl backend's local kernels: ``grid=None``) takes the grid as its first per-call value.

Both backends launch through it: the triton backend's :class:`tritonep.ep.triton.calls.KernelSet` (static grids,
every launch recorded) and the nccl backend's :class:`tritonep.ep.nccl.pack.Launch` (per-call grids, not recorded:
those kernels signal nobody, so a rank may skip or resize them by its data, docs/protocols.md (host protocol rule)).

How a bound kernel launches:

* recorder / precompile: like :class:`tritonep.ep.triton.launch.Launcher` (the protocol recorder sees
  ``("launch", name, grid)`` unless the kernel was bound with ``record=False``; inside ``Launcher.precompile`` the
  kernel is compiled, not run).
* CPU (interpreter) and the first launch of each variant on the GPU: ``kernel[grid](*args, **options)``, Triton's
  own path.
* later GPU launches (``TRITONEP_FAST_LAUNCH=1``, the default): the compiled kernel's C launcher is called
  directly with the static tensors already turned into device addresses (Python ints: no ``data_ptr()`` call and
  no ``cuPointerGetAttribute`` per argument), the current raw stream, and the per-call values. The variant is
  picked by Triton's own specialisation of the per-call values only (``native_specialize_impl``: dtype and
  16-byte alignment of tensors, ``== 1`` / ``% 16`` of ints that are specialised; a constexpr by its value), because
  the static ones never change (the grid is not part of a variant: Triton compiles without it). A kernel that needs
  Triton's global or profile scratch, or a launch while a Triton launch hook is installed (a profiler), takes
  Triton's own path; with no hook installed Triton hands its launcher its empty hook chains and their metadata,
  which do nothing, so the direct call passes None for both. The arguments handed to the C launcher are exactly those
  :meth:`triton.compiler.CompiledKernel.__getitem__`'s runner hands it (``tests/ep/test_bound_launch.py``).

Idea: the "call the compiled kernel's launcher directly" pattern of vLLM's ``CachedKernel`` (vllm PR #34838:
8.68 -> 4.51 us per launch) and helion PR #3004 (``CompiledKernel.run`` floor ~5.6 us), applied with the static
arguments pre-converted once per buffer.
"""

from __future__ import annotations

import inspect

import torch

from . import recorder as _rec

__all__ = ["BoundKernel", "bound_launch_enabled"]

_EMPTY = inspect.Parameter.empty


def _hooks_idle() -> bool:
    """No Triton launch hook is installed (Triton 3.6 keeps an empty ``HookChain``; a profiler adds calls to it)."""
    from triton import knobs  # a cached module: the import statement costs a dict lookup, the object is live

    rt = knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


def bound_launch_enabled(device: torch.device) -> bool:
    """Direct C-launcher calls on this device (CUDA and ``TRITONEP_FAST_LAUNCH=1``, the default)."""
    from .. import envs

    return device.type == "cuda" and envs.fast_launch()


class BoundKernel:
    """``bk(*dyn_values)`` launches ``kernel[grid](*args, **options)`` with ``args`` = the static values bound at
    construction and ``dyn_values`` in the parameters named by ``dyn`` (see the module docstring); with
    ``grid=None`` a call is ``bk(grid, *dyn_values)``.

    Args:
        launcher: the owner's launch context: :class:`tritonep.ep.triton.launch.Launcher` or
            :class:`tritonep.ep.nccl.pack.Launch` (read: ``device``, ``max_programs``, the precompile flag).
        kernel: a ``@triton.jit`` function (or its interpreted form on CPU).
        grid: the launch grid when the static configuration decides it, else None (the grid is then the first
            value of every call: a tuple of 1 to 3 ints).
        static: parameter name -> value for every parameter not in ``dyn`` that has no default (or should not
            take its default); compile options (``num_warps``, ``num_stages``) are recognised by name.
        dyn: the per-call parameter names, in the order a call passes their values.
        record: report each launch to the protocol recorder (signalling kernels must; local kernels whose launch
            depends on the rank's data must not).

    Raises:
        TypeError: a parameter neither bound nor per-call and without a default, or an unknown name; a call with
            another number of per-call values (checked on Triton's own path: every CPU launch, a variant's first).
        ConfigError: a grid larger than the launcher's ``TRITONEP_MAX_PROGRAMS`` cap (at construction for a static
            grid, at the call for a per-call grid).
    """

    _OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

    def __init__(self, launcher, kernel, grid, static: dict, dyn: tuple, record: bool = True):
        fn = getattr(kernel, "fn", kernel)
        params = list(inspect.signature(fn).parameters.values())
        names = [p.name for p in params]
        unknown = [n for n in list(static) + list(dyn) if n not in names and n not in self._OPTIONS]
        if unknown:
            raise TypeError(f"{fn.__name__}: unknown parameters {unknown}")
        self.options = {k: v for k, v in static.items() if k in self._OPTIONS}
        tmpl = []
        for p in params:
            if p.name in dyn:
                tmpl.append(None)
            elif p.name in static:
                tmpl.append(static[p.name])
            elif p.default is not _EMPTY:
                tmpl.append(p.default)
            else:
                raise TypeError(f"{fn.__name__}: parameter {p.name!r} is neither bound nor per-call")
        self.kernel, self.name = kernel, fn.__name__
        self.grid = None if grid is None else tuple(grid)
        self._cap = getattr(launcher, "max_programs", 0)
        if self.grid is not None:
            self._check_grid(self.grid)
        self._launcher = launcher
        self._record = record
        self._tmpl = tmpl
        self._pos = tuple(names.index(d) for d in dyn)
        self._dyn = tuple(dyn)
        self._grid3 = None if grid is None else tuple(self.grid) + (1,) * (3 - len(self.grid))
        self._fast = bound_launch_enabled(launcher.device)
        self._variants: dict = {}  # specialisation of the per-call values -> (launch, function, metadata, coop, pdl)
        self._int_tmpl = None  # the static arguments as device addresses (after the first compile)
        self._spec = None  # per-call parameter -> (is_const, specialize, align) for native_specialize_impl; ()
        # for a constexpr, whose value itself selects the variant
        self._backend = None
        self._specialize = None  # triton's native_specialize_impl, looked up once with the first variant
        self._dev = launcher.device.index if launcher.device.index is not None else 0

    def _check_grid(self, grid):
        if self._cap and grid[0] > self._cap:
            from ..errors import ConfigError

            raise ConfigError(f"{self.name}: grid {tuple(grid)} exceeds TRITONEP_MAX_PROGRAMS={self._cap} (ranks that "
                              f"share a GPU must fit their waiting programs on the chip together; docs/platform.md)")

    # ------------------------------------------------------------------------------------------------ launch
    def __call__(self, *dyn):
        grid = self.grid
        if grid is None:  # per-call grid: the first value
            grid, dyn = dyn[0], dyn[1:]
            if self._cap:
                self._check_grid(grid)
        lau = self._launcher
        if lau._warmup:
            args = self._args(dyn)
            self.kernel.warmup(*args, grid=grid, **self.options)
            return
        if self._record and _rec._RECORDER is not None:
            _rec._RECORDER(("launch", self.name, tuple(grid)))
        if self._fast:
            ent = self._variants.get(self._key(dyn)) if self._spec is not None else None
            if ent is not None:
                if _hooks_idle():
                    args = self._int_tmpl.copy()
                    for p, v in zip(self._pos, dyn):
                        args[p] = v.data_ptr() if isinstance(v, torch.Tensor) else v
                    launch, function, meta, coop, pdl = ent
                    g = self._grid3
                    if g is None:
                        n = len(grid)
                        g = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
                    launch(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self._dev), function, coop, pdl,
                           None, None, meta, None, None, None, *args)
                    return
        compiled = self.kernel[grid](*self._args(dyn), **self.options)
        if self._fast:
            self._remember(compiled, dyn)

    def _args(self, dyn) -> list:
        """Every argument of Triton's own path (the CPU's every launch, a GPU variant's first): the static ones and
        ``dyn``, whose count is checked here (a missing pointer would reach the kernel as None)."""
        if len(dyn) != len(self._pos):
            raise TypeError(f"{self.name}: {len(dyn)} per-call values, bound for {len(self._pos)}: {self._dyn}")
        args = self._tmpl.copy()
        for p, v in zip(self._pos, dyn):
            args[p] = v
        return args

    # ------------------------------------------------------------------------------------------------ variants
    def _key(self, dyn) -> tuple:
        """Triton's own specialisation of the per-call values (what selects the compiled variant)."""
        b, spec = self._backend, self._specialize
        return tuple(spec(b, v, *f) if f else v for v, f in zip(dyn, self._spec))

    def _remember(self, compiled, dyn):
        """After Triton's own launch: bind the compiled variant for the direct path (when it allows one)."""
        run = getattr(compiled, "run", None)
        launch = getattr(run, "launch", None)
        if launch is None or getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
            return  # scratch buffers are allocated by Triton's Python launcher: keep its path
        if self._spec is None:
            from triton.runtime.jit import native_specialize_impl

            self._specialize = native_specialize_impl
            kp = self.kernel.params
            # a constexpr is its value (Triton's binder: ("constexpr", value)); () marks one
            self._spec = tuple(() if kp[p].is_constexpr else (kp[p].is_const, not kp[p].do_not_specialize,
                                                                not kp[p].do_not_specialize_on_alignment)
                               for p in self._pos)
            device = self._dev
            self._backend = self.kernel.device_caches[device][3]
            self._int_tmpl = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self._tmpl]
        self._variants[self._key(dyn)] = (launch, compiled.function, compiled.packed_metadata,
                                          run.launch_cooperative_grid, run.launch_pdl)
