"""A kernel launch bound once: every static argument fixed at construction, a call fills a few slots.

A :class:`BoundKernel` is one kernel of one buffer's call path (e.g. the dispatch's send kernel) with its compile
options, every argument the static configuration decides (region views, pointer tables, tiles, ranks, wires) and,
where the configuration decides it, its grid filled in at construction. A call passes only the per-call values
(input tensors, this call's handle storage, T), in a fixed order (``dyn``); a kernel whose grid follows this call's
data (the nccl backend's local kernels: ``grid=None``) takes the grid as its first per-call value.

Every launch of both backends is one, made by an owner's launch runtime (:meth:`tritonep.runtime.launch.Launch.bind`):
the triton backend's (static grids, every launch recorded: :class:`tritonep.backends.triton.calls.KernelSet`, its
counts exchange and expert transport) and the nccl backend's (per-call grids, not recorded: those kernels signal
nobody, so a rank may skip or resize them by its data, docs/protocols.md (host protocol rule)).

How a bound kernel launches:

* recorder / precompile: the protocol recorder sees ``("launch", name, grid)`` unless the kernel was bound with
  ``record=False``; inside its launch runtime's :meth:`tritonep.runtime.launch.Launch.precompile` the
  kernel is compiled, not run, and on the GPU the compiled variant is bound for the direct path at once: the
  owner's dry run at construction makes the first real call of a fresh buffer direct when its values specialise
  like the dry run's).
* CPU (interpreter) and the first launch of each variant not bound by a dry run on the GPU: ``kernel[grid](*args,
  **options)``, Triton's own path; the variant it compiled is then bound.
* later GPU launches (launch mode ``packed`` or ``direct``, :class:`tritonep.runtime.launch.Launch`): the compiled
  kernel's C launcher (``packed``: the variant's packed C entry, :mod:`tritonep.runtime.packed_launch`) is called
  directly with the static tensors already turned into device addresses (Python ints, literals in the launch's
  generated source: no ``data_ptr()`` call and no ``cuPointerGetAttribute`` per argument), the current raw stream,
  and the per-call values. The variant is picked by a key of the per-call values only, computed by one function
  generated at the first binding (:meth:`BoundKernel._bind`, the same source for binding and look-up), exactly as
  fine as Triton's own specialisation (``native_specialize_impl``: dtype and 16-byte alignment of tensors, the
  address computed once and also passed to the launch; ``== 1`` / ``% 16`` and the int32 range of ints that are
  specialised; a constexpr by its type and value; see :func:`_spec_exprs`), because the static ones never change
  (the grid is not part of a variant: Triton compiles without it). A kernel that needs Triton's global or profile
  scratch, a per-call value of another kind than at binding (e.g. a tensor where None was), or a launch while a
  Triton launch hook is installed (a profiler; checked by identity and emptiness of Triton's two hook chains), takes
  Triton's own path; with no hook installed Triton hands its launcher its empty hook chains and their metadata,
  which do nothing, so the direct call passes None for both. The arguments handed to the C launcher are exactly those
  :meth:`triton.compiler.CompiledKernel.__getitem__`'s runner hands it (``tests/runtime/test_bound_launch.py``). Host
  cost of the direct path without a GPU: ``benchmarks/probes/bound_overhead.py``.

Idea: the "call the compiled kernel's launcher directly" pattern of vLLM's ``CachedKernel`` (vllm PR #34838:
8.68 -> 4.51 us per launch) and helion PR #3004 (``CompiledKernel.run`` floor ~5.6 us), applied with the static
arguments pre-converted once per buffer.
"""

from __future__ import annotations

import inspect

import torch

from . import recorder as _rec
from .field_view import FieldView

__all__ = ["BoundKernel", "bound_launch_enabled", "STORE"]

_EMPTY = inspect.Parameter.empty
STORE = "@store"  # the per-call value of a kernel bound with ``fields``: the int32 storage block they live in


def _hooks_idle() -> bool:
    """No Triton launch hook is installed (Triton 3.6 keeps an empty ``HookChain``; a profiler adds calls to it)."""
    from triton import knobs  # a cached module: the import statement costs a dict lookup, the object is live

    rt = knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


def bound_launch_enabled(launcher) -> bool:
    """Direct C-launcher calls for the bound kernels of ``launcher`` (its launch runtime): a CUDA device and a
    launch mode other than ``"triton"`` (:class:`tritonep.runtime.launch.Launch`, the config's ``launch``)."""
    return launcher.device.type == "cuda" and getattr(launcher, "direct", True)


class BoundKernel:
    """``bk(*dyn_values)`` launches ``kernel[grid](*args, **options)`` with ``args`` = the static values bound at
    construction and ``dyn_values`` in the parameters named by ``dyn`` (see the module docstring); with
    ``grid=None`` a call is ``bk(grid, *dyn_values)``.

    Args:
        launcher: the owner's launch runtime, :class:`tritonep.runtime.launch.Launch` (read: ``device``,
            ``max_programs``, the precompile flag); :meth:`tritonep.runtime.launch.Launch.bind` makes bound kernels.
        kernel: a ``@triton.jit`` function (or its interpreted form on CPU).
        grid: the launch grid when the static configuration decides it, else None (the grid is then the first
            value of every call: a tuple of 1 to 3 ints).
        static: parameter name -> value for every parameter not in ``dyn`` that has no default (or should not
            take its default); compile options (``num_warps``, ``num_stages``) are recognised by name.
        dyn: the per-call parameter names, in the order a call passes their values.
        record: report each launch to the protocol recorder (signalling kernels must; local kernels whose launch
            depends on the rank's data must not).
        fields: parameter name -> ``(start, numel, dtype)`` for parameters that are fields of ONE per-call int32
            storage block (the triton backend's handle storage, :class:`tritonep.backends.triton.outputs.HandleLayout`):
            the block itself is the per-call value named :data:`STORE` in ``dyn``, and each field parameter gets
            the block's address plus the field's static byte offset (``4 * start``) on the direct path, or the view
            ``block[start:start + numel]`` (reinterpreted as ``dtype``) on Triton's own path. One per-call value
            (one address, one 16-byte alignment test in the variant key) instead of one per field: the block's
            fields are at fixed offsets, so their alignments follow the block's.

    Raises:
        TypeError: a parameter neither bound nor per-call and without a default, or an unknown name; a call with
            another number of per-call values (checked on Triton's own path: every CPU launch, a variant's first).
        ConfigError: a grid larger than the launcher's ``TRITONEP_MAX_PROGRAMS`` cap (at construction for a static
            grid, at the call for a per-call grid).
    """

    _OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

    def __init__(self, launcher, kernel, grid, static: dict, dyn: tuple, record: bool = True,
                 fields: dict | None = None):
        fn = getattr(kernel, "fn", kernel)
        params = list(inspect.signature(fn).parameters.values())
        names = [p.name for p in params]
        fields = fields or {}
        unknown = [n for n in list(static) + list(dyn) + list(fields)
                   if n not in names and n not in self._OPTIONS and n != STORE]
        if unknown:
            raise TypeError(f"{fn.__name__}: unknown parameters {unknown}")
        if bool(fields) != (STORE in dyn):
            raise TypeError(f"{fn.__name__}: field parameters {list(fields)} need the per-call value {STORE!r} in "
                            f"dyn, and it needs them")
        self.options = {k: v for k, v in static.items() if k in self._OPTIONS}
        tmpl = []
        for p in params:
            if p.name in dyn or p.name in fields:
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
        self._pos = tuple(-1 if d == STORE else names.index(d) for d in dyn)
        self._fields = tuple((names.index(n), int(st), int(nu), dt) for n, (st, nu, dt) in fields.items())
        self._dyn = tuple(dyn)
        self._names = tuple(names)
        self._grid3 = None if grid is None else tuple(self.grid) + (1,) * (3 - len(self.grid))
        self._fast = bound_launch_enabled(launcher)
        self._packed = self._fast and getattr(launcher, "packed", True)
        self._cpos: tuple = ()  # positions of the parameters a call fills (per-call values, storage fields): _bind
        self._cset: frozenset = frozenset()
        self._variants: dict = {}  # variant key of the per-call values -> (launch, function, metadata, coop, pdl)
        self._keyof = self._direct = None  # built with the first bound variant (_bind)
        self._src = ""  # their source (for reading and tests)
        self._dev = launcher.device.index if launcher.device.index is not None else 0

    def _check_grid(self, grid):
        if self._cap and grid[0] > self._cap:
            from ..errors import ConfigError

            raise ConfigError(f"{self.name}: grid {tuple(grid)} exceeds TRITONEP_MAX_PROGRAMS={self._cap} (ranks that "
                              f"share a GPU must fit their waiting programs on the chip together; docs/platform.md)")

    # ------------------------------------------------------------------------------------------------ launch
    def __call__(self, *dyn):
        if self.grid is None and self._cap:  # per-call grid: the first value
            self._check_grid(dyn[0])
        if self._launcher._warmup:
            return self._warm(dyn)
        if self._record and _rec._RECORDER is not None:
            _rec._RECORDER(("launch", self.name, tuple(dyn[0] if self.grid is None else self.grid)))
        direct = self._direct
        if direct is not None and direct(dyn):
            return
        grid, vals = (self.grid, dyn) if self.grid is not None else (dyn[0], dyn[1:])
        compiled = self.kernel[grid](*self._args(vals), **self.options)
        if self._fast:
            self._remember(compiled, dyn)

    def arg(self, name: str, dyn: tuple = ()):
        """The value parameter ``name`` takes in a call with per-call values ``dyn`` (as the call passes them; a
        static parameter's bound value needs none; a field parameter's is a
        :class:`tritonep.runtime.field_view.FieldView` of the call's storage block). Raises ValueError for an unknown
        name."""
        vals = dyn if self.grid is not None else dyn[1:]
        for pos, start, numel, dt in self._fields:
            if self._names[pos] == name:
                if len(vals) != len(self._dyn):
                    raise ValueError(f"{self.name}: {name!r} is a field of the per-call storage block: pass the call's "
                                     f"per-call values ({self._dyn}) to read it")
                store = vals[self._dyn.index(STORE)]
                return FieldView(store, store.data_ptr(), start, numel, dt)
        if name in self._dyn:
            return vals[self._dyn.index(name)]
        return self._tmpl[self._names.index(name)]

    def _warm(self, dyn):
        """Precompile (the owner's dry run): compile this call's variant and bind it for the direct path, so the
        first real call with the same specialisation already launches directly."""
        grid, vals = (self.grid, dyn) if self.grid is not None else (dyn[0], dyn[1:])
        compiled = self.kernel.warmup(*self._args(vals), grid=grid, **self.options)
        if self._fast and compiled is not None and not hasattr(compiled, "result"):  # not an async compile's future
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                try:  # a warm-up leaves the binary unloaded (function None): load it now, as a first launch would
                    init()
                except Exception:  # noqa: BLE001 - a variant that cannot load (OutOfResources) raises at its
                    return  # first real launch on Triton's path, as before
            self._remember(compiled, dyn)

    def _args(self, dyn) -> list:
        """Every argument of Triton's own path (the CPU's every launch, a GPU variant's first): the static ones and
        ``dyn``, whose count is checked here (a missing pointer would reach the kernel as None)."""
        if len(dyn) != len(self._pos):
            raise TypeError(f"{self.name}: {len(dyn)} per-call values, bound for {len(self._pos)}: {self._dyn}")
        args = self._tmpl.copy()
        store = None
        for p, v in zip(self._pos, dyn):
            if p < 0:
                store = v
                continue
            args[p] = v.tensor() if v.__class__ is FieldView else v  # Triton's path gets tensors, never a FieldView
        for pos, start, numel, dt in self._fields:  # the storage block's fields, as views
            t = store[start:start + numel]
            args[pos] = t if dt is torch.int32 else t.view(dt)
        return args

    # ------------------------------------------------------------------------------------------------ variants
    def _remember(self, compiled, dyn):
        """After Triton's own launch or a warm-up compile: bind the compiled variant for the direct path (when it
        allows one), under the key :meth:`key_of` gives for this call's values (``dyn``: what the call was given,
        the grid first when it is per-call)."""
        run = getattr(compiled, "run", None)
        launch = getattr(run, "launch", None)
        if launch is None or getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
            return  # scratch buffers are allocated by Triton's Python launcher: keep its path
        if self._keyof is None:
            self._bind(dyn)
        try:
            key = self._keyof(dyn)
        except _MISSES:  # values of another kind than at binding (e.g. a tensor where None was): Triton's path
            return
        ent = None
        if self._packed:  # the variant's parameters packed once: a launch passes only the per-call values
            from . import packed_launch

            static = {pos: (v.data_ptr() if isinstance(v, torch.Tensor) else v)
                      for pos, v in enumerate(self._tmpl) if pos not in self._cset}
            ent = packed_launch.bind(compiled, static, self._cpos, self._grid3)
        if ent is None:  # Triton's own C launcher with every argument
            ent = (launch, compiled.function, compiled.packed_metadata, run.launch_cooperative_grid, run.launch_pdl)
        self._variants[key] = ent

    def key_of(self, dyn) -> tuple | None:
        """The variant key of a call's values (``dyn`` as the call passes them), or None before the first variant
        was bound or for values the direct path does not take (then Triton's own path runs). Two calls share a key
        only if Triton's binder gives them the same specialisation (see :func:`_spec_exprs`)."""
        if self._keyof is None:
            return None
        try:
            return self._keyof(dyn)
        except _MISSES:
            return None

    def _bind(self, dyn):
        """Build, once, the two functions of the direct path from one source: ``keyof(dyn)`` (the variant key) and
        ``direct(dyn)`` (key, look-up, launch; False when the call must take Triton's path). The kind of every
        per-call value (tensor, Python int, None, other) is taken from this first bound call; a later value of
        another kind fails a guard and takes Triton's path (correct, not fast)."""
        from triton import knobs
        from triton.runtime.jit import native_specialize_impl

        kp = self.kernel.params
        ns = {"_spec": native_specialize_impl, "_b": self.kernel.device_caches[self._dev][3], "_Other": _Other,
              "_get": self._variants.get, "_idle": _hooks_idle, "_stream": torch._C._cuda_getCurrentRawStream,
              "_MISSES": _MISSES}
        rt = knobs.runtime
        e, x = rt.launch_enter_hook, rt.launch_exit_hook
        if hasattr(e, "calls") and hasattr(x, "calls"):  # the empty HookChains: identity + emptiness, no call
            ns.update(_rt=rt, _E=e, _X=x, _Ec=e.calls, _Xc=x.calls)
            idle = "(_rt.launch_enter_hook is _E and _rt.launch_exit_hook is _X and not _Ec and not _Xc or _idle())"
        else:
            idle = "_idle()"
        vals = dyn if self.grid is not None else dyn[1:]
        names = [f"a{j}" for j in range(len(vals))]
        unpack = ", ".join(([] if self.grid is not None else ["g"]) + names)
        stmts, key, cargs = [f"{unpack}, = d"] if unpack else [], [], {}
        for j, (pos, v) in enumerate(zip(self._pos, vals)):
            if pos < 0:  # the storage block: its address once; its fields' alignments all follow its own
                if not (isinstance(v, torch.Tensor) and v.dtype is torch.int32):
                    raise TypeError(f"{self.name}: the {STORE} value must be an int32 tensor, got {v!r}")
                stmts.append(f"ps = a{j}.data_ptr()")
                key.append("ps & 15")  # the residue: with it every field's own 16-byte alignment is known
                for fpos, start, _, _ in self._fields:
                    cargs[fpos] = f"(ps + {4 * start})"
                continue
            s, k, c = _spec_exprs(f"a{j}", v, kp[pos], ns)
            stmts += s
            key += k
            cargs[pos] = c
        args = []
        for pos, v in enumerate(self._tmpl):
            if pos in cargs:
                args.append(cargs[pos])
            else:
                args.append(_literal(v.data_ptr() if isinstance(v, torch.Tensor) else v, f"_s{pos}", ns))
        if self.grid is not None:
            gx, gy, gz = (str(int(v)) for v in self._grid3)
        else:
            stmts += ["n = len(g)", "gx = g[0]", "gy = g[1] if n > 1 else 1", "gz = g[2] if n > 2 else 1"]
            gx, gy, gz = "gx", "gy", "gz"
        self._cpos = tuple(sorted(cargs))
        self._cset = frozenset(self._cpos)
        if self._packed:
            from . import packed_launch

            mod = packed_launch.module()
            if mod is None:
                self._packed = False
            else:
                ns.update(_run=mod.run, _run_grid=mod.run_grid)
        cvals = "".join(f", {cargs[p]}" for p in self._cpos)
        packed = (f"_run(ent, _stream({self._dev}){cvals})" if self.grid is not None else
                  f"_run_grid(ent, gx, gy, gz, _stream({self._dev}){cvals})")
        keyx = "(" + "".join(f"{k}, " for k in key) + ")"
        body = "\n".join("        " + st for st in stmts or ["pass"])
        src = (f"def keyof(d):\n    if True:\n{body}\n    return {keyx}\n\n"
               f"def direct(d):\n    try:\n{body}\n        ent = _get({keyx})\n    except _MISSES:\n        return False\n"
               f"    if ent is None or not {idle}:\n        return False\n"
               + (f"    if ent.__class__ is not tuple:\n        {packed}\n        return True\n" if self._packed else "")
               + f"    launch, function, meta, coop, pdl = ent\n"
               f"    launch({gx}, {gy}, {gz}, _stream({self._dev}), function, coop, pdl, None, None, meta, None, None, "
               f"None, {', '.join(args)})\n    return True\n")
        exec(compile(src, f"<BoundKernel {self.name}>", "exec"), ns)
        self._keyof, self._direct, self._src = ns["keyof"], ns["direct"], src


class _Other(Exception):
    """A per-call value of another kind than at binding (the direct path's guard)."""


_MISSES = (_Other, AttributeError, TypeError, ValueError)


def _literal(v, name: str, ns: dict) -> str:
    """Source text of a static argument: an int / bool / None literal, else a name bound in ``ns``."""
    if v is None or type(v) in (int, bool):
        return repr(v)
    ns[name] = v
    return name


def _spec_exprs(a: str, v, kp, ns: dict) -> tuple:
    """``(statements, key parts, C-launcher argument)`` for per-call value ``a`` of parameter ``kp``, by the kind
    of its first bound value ``v``. The key parts are exactly as fine as Triton's binder (``native_specialize_impl``
    with the parameter's ``is_const`` / ``do_not_specialize`` / ``do_not_specialize_on_alignment``), or finer:

    * constexpr parameter: ``(type, value)`` (Triton: the value);
    * tensor: ``dtype`` and, when specialised on alignment, ``data_ptr & 15 == 0`` (Triton: ``*dtype`` and "D"),
      the address computed once, also the argument the launch passes;
    * Python int in int32 range: 0, or with specialisation ``1`` for 1 (Triton makes it a constexpr) and, with
      alignment, ``16`` for multiples of 16 ("D"); any other int (other range, bool) Triton's own tuple;
    * None: guarded (another kind raises ``_Other``: Triton's path); anything else: Triton's own tuple.
    """
    if kp.is_constexpr:
        return [], [f"{a}.__class__", a], a
    spec, align = not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
    native = f"_spec(_b, {a}, {kp.is_const}, {spec}, {align})"
    if isinstance(v, (torch.Tensor, FieldView)):  # a FieldView: an address and a dtype, like a tensor here
        p = "p" + a[1:]
        return [f"{p} = {a}.data_ptr()"], [f"{a}.dtype"] + ([f"{p} & 15 == 0"] if spec and align else []), p
    if v is None:
        return [f"if {a} is not None: raise _Other"], [], a
    if type(v) is int:
        cls = "(1 if {a} == 1 else 16 if not {a} & 15 else 0)" if spec and align else \
            "(1 if {a} == 1 else 0)" if spec else "0"
        return [], [f"{cls.format(a=a)} if {a}.__class__ is int and -2147483648 <= {a} <= 2147483647 else {native}"], a
    return [], [native], a
