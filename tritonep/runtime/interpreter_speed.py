"""The same language patches of Triton 3.6's CPU interpreter, found without scanning every module member each time.

Triton's interpreter swaps ``triton.language``'s builtins for its numpy ones on every launch and again on EVERY call
of a ``@triton.jit`` helper (``InterpretedFunction.__call__`` -> ``_patch_lang``). Its ``_patch_builtin(pkg, ...)``
finds the builtins with ``inspect.getmembers(pkg)`` (``dir``, a sort and a ``getattr`` of each of ~600 members of
``tl``, ``tl.core``, ``tl.tensor``, ``tl.math``, ``tl.core.tensor_descriptor_base``). In a CPU world that scan was a
third of a rank's time: cProfile of one rank of
``tests/ep/test_dispatch_combine.py::test_only_rank0_has_tokens_100_calls`` (10 calls): ``_patch_lang`` 3.5 s of
10.1 s, 2006 calls, 97 % of them helper calls.

:func:`install` (called by the launch runtime for a CPU device, :func:`tritonep.testing.run_cpu_world` before it forks
its ranks, and the test suite's conftest when it interprets) changes three things,
each doing what the interpreter did:

* ``_patch_builtin`` visits only the names a first scan of each package found to be builtins (the scan is made
  here, on the unpatched modules) and still checks ``is_builtin`` on each member as it is now, so it patches exactly
  the attributes the original patches, in the same (sorted) order;
* ``_patch_lang`` called for a helper inside a running launch returns at once when every language module the helper
  sees is already patched: by the launch itself (restored when the launch ends) or by an earlier helper of the
  launch (the interpreter never restores a helper's patches); anything else goes to the original;
* ``_get_np_dtype`` answers the scalar dtypes from a table taken from the original (which built a dict of 19
  dtypes on every call).
* ``GridExecutor._init_args_hst`` / ``_restore_args_dev`` (the host copies of a launch's tensor arguments and the
  copy back) walk the arguments with module functions instead of recursive closures: the original closures refer to
  themselves, so every launch left a reference cycle holding its arguments' storage objects (``untyped_storage()``)
  until the next garbage collection, and the triton backend's output pool (:mod:`tritonep.runtime.pool`, which
  counts references to those objects) saw its sets held until then.

Together: the 100-call only-rank-0 test 89 -> 56 s of CPU before the wait pause of :mod:`.signal`.
``tests/runtime/test_interpreter_speed.py`` holds the patches and dtypes equal to the original's. Only Triton 3.6.x,
whose interpreter this was read from; on any other version (or if a function is not there) nothing changes.
Compiled (GPU) kernels never go through the interpreter.
"""

from __future__ import annotations

import inspect

__all__ = ["install", "builtin_names"]

_NAMES: dict = {}  # id(package) -> sorted builtin member names of the unpatched package


def builtin_names(pkg) -> list:
    """The names of ``pkg``'s members that are Triton builtins, as the interpreter's own scan finds them (sorted)."""
    import triton.language as tl

    return [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]


def _packages():
    import triton.language as tl

    return [tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base]


def _fast_np_dtype(original):
    """``_get_np_dtype`` without building its dict of 19 dtypes on every call: the answers of the original for the
    scalar dtypes, taken once; anything else (pointers, dtypes not in the table) goes to the original."""
    import triton.language as tl

    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
               tl.float8e4b15]
    table = {t: original(t) for t in scalars}
    dtype, block_type = tl.dtype, tl.block_type

    def _get_np_dtype(tt_dtype):
        kind = type(tt_dtype)
        if kind is block_type:
            kind, key = type(tt_dtype.element_ty), tt_dtype.element_ty
        else:
            key = tt_dtype
        if kind is dtype:
            got = table.get(key)
            if got is not None:
                return got
        return original(tt_dtype)

    return _get_np_dtype


def _to_cpu(interp, storages: dict, arg):
    """Triton 3.6 ``GridExecutor._init_args_hst``'s ``_to_cpu`` closure, same steps, as a function (no cycle)."""
    if isinstance(arg, tuple):
        return interp._tuple_create(arg, [_to_cpu(interp, storages, a) for a in arg])
    if isinstance(arg, interp.TensorDescriptor):
        return interp.TensorDescriptor(_to_cpu(interp, storages, arg.base), arg.shape, arg.strides, arg.block_shape,
                                       arg.padding)
    if not hasattr(arg, "data_ptr"):
        return arg
    unwrapped_arg = interp._unwrap_tensor(arg)
    if unwrapped_arg.untyped_storage().data_ptr() not in storages:
        storage = unwrapped_arg.untyped_storage()
        storages[storage.data_ptr()] = storage.cpu()
    storage = storages[unwrapped_arg.untyped_storage().data_ptr()]
    cpu_arg = unwrapped_arg.new_empty(0, device="cpu")
    cpu_arg.set_(storage, unwrapped_arg.storage_offset(), unwrapped_arg.size(), unwrapped_arg.stride())
    return interp._rewrap_tensor(cpu_arg, original_tensor=arg)


def _from_cpu(interp, storages: dict, arg_dev, arg_hst):
    """Triton 3.6 ``GridExecutor._restore_args_dev``'s ``_from_cpu`` closure, same steps, as a function (no cycle)."""
    if hasattr(arg_dev, "data_ptr"):
        arg_dev, arg_hst = interp._unwrap_tensor(arg_dev), interp._unwrap_tensor(arg_hst)
        storages[arg_dev.untyped_storage().data_ptr()] = (arg_dev.untyped_storage(), arg_hst.untyped_storage())
    elif isinstance(arg_dev, tuple):
        for d, h in zip(arg_dev, arg_hst):
            _from_cpu(interp, storages, d, h)
    elif isinstance(arg_dev, interp.TensorDescriptor):
        _from_cpu(interp, storages, arg_dev.base, arg_hst.base)


def _args_functions(interp):
    """``(_init_args_hst, _restore_args_dev)`` of ``GridExecutor`` without reference cycles (module docstring)."""

    def _init_args_hst(self, args_dev, kwargs):
        storages: dict = {}
        args_hst = [_to_cpu(interp, storages, arg) for arg in args_dev]
        kwargs_hst = {key: _to_cpu(interp, storages, value) for key, value in kwargs.items()}
        return args_hst, kwargs_hst

    def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        storages: dict = {}
        for arg_dev, arg_hst in zip(args_dev, args_hst):
            _from_cpu(interp, storages, arg_dev, arg_hst)
        for key, kwarg_dev in kwargs.items():
            _from_cpu(interp, storages, kwarg_dev, kwargs_hst[key])
        for arg_dev, arg_hst in storages.values():
            arg_dev.copy_(arg_hst)

    return _init_args_hst, _restore_args_dev


def install() -> bool:
    """Put the faster interpreter functions in place (idempotent). Returns True when they are in place, False on a
    Triton this was not read from (nothing changed then)."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_tritonep_fast", False):
        return True
    needed = ("_patch_builtin", "_patch_attr", "_patch_lang", "_get_np_dtype", "GridExecutor", "InterpretedFunction",
              "_LangPatchScope", "_tuple_create", "_unwrap_tensor", "_rewrap_tensor", "TensorDescriptor")
    if not triton.__version__.startswith("3.6.") or not all(hasattr(interpreter, n) for n in needed):
        return False
    for pkg in _packages():
        _NAMES[id(pkg)] = builtin_names(pkg)
    is_builtin, patch_attr = tl.core.is_builtin, interpreter._patch_attr
    original_builtin, original_lang = interpreter._patch_builtin, interpreter._patch_lang
    original_grid_call = interpreter.GridExecutor.__call__
    launches = []  # per running launch: [its kernel's language modules, patched yet]
    langs_of: dict = {}  # id(fn.__globals__) -> the language modules a function sees (as _patch_lang finds them)

    def _langs(fn):
        key = id(fn.__globals__)
        got = langs_of.get(key)
        if got is None:
            got = langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                            if inspect.ismodule(v) and v in [tl, tl.core])
        return got

    def _patch_builtin(pkg, builder, scope):
        names = _NAMES.get(id(pkg))
        if names is None:  # a package not scanned here: the interpreter's own scan
            return original_builtin(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    def _patch_lang(fn):
        if launches:
            top = launches[-1]
            if not top[1]:  # the launch's own patch (GridExecutor.__call__): restored when the launch ends
                top[1] = True
                return original_lang(fn)
            langs = _langs(fn)
            if langs <= top[0]:  # a helper inside the launch: its modules are patched until the launch ends
                return interpreter._LangPatchScope()
            scope = original_lang(fn)  # a helper that sees more modules (tl.sum sees tl.core): patched, never
            top[0] = top[0] | langs  # restored by the interpreter, so patched for the rest of the launch too
            return scope
        return original_lang(fn)

    def _grid_call(self, *args, **kwargs):
        launches.append([_langs(self.fn), False])
        try:
            return original_grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_builtin = _patch_builtin
    interpreter._patch_lang = _patch_lang
    interpreter._get_np_dtype = _fast_np_dtype(interpreter._get_np_dtype)
    interpreter.GridExecutor.__call__ = _grid_call
    grid = interpreter.GridExecutor
    if all(hasattr(grid, n) for n in ("_init_args_hst", "_restore_args_dev")):
        grid._init_args_hst, grid._restore_args_dev = _args_functions(interpreter)
    interpreter._tritonep_fast = True
    return True
