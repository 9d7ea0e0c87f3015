"""Every TRITONEP_* environment variable, read in one place.

| variable | default | meaning |
|---|---|---|
| TRITONEP_TIMEOUT_S | 300 | default bound of every in-kernel wait, seconds (per object: ``timeout_s=``) |
| TRITONEP_SYNC_CHECKS | deferred | ``deferred``: an eager dispatch reads (status, received rows) once, after the counts exchange, and raises any error recorded since the last read (a peer lost mid-call raises at the next dispatch); combine and backward read nothing. ``1`` (strict): also one status read at the end of every call, so a peer lost mid-call raises in that call. ``0``: no host read at all (as under graph capture; rows sized ``max_recv_tokens``) |
| TRITONEP_NUM_SMS | 0 (= kernel-tile table) | cap on the programs (SMs) a communication kernel may use |
| TRITONEP_MAX_PROGRAMS | 0 (= none) | per-process cap on the programs of every kernel that waits on another rank (every launch of the EP kernels, counts exchange, expert transport; a larger grid is a ConfigError at launch). Unlike TRITONEP_NUM_SMS it changes no choice of the kernel-tile table, it only clips grids. ``tritonep.testing.run_gpu_world(mps=True)`` sets it in every rank of ranks that share a GPU under MPS, so all their programs fit on the chip at once (docs/platform.md) |
| TRITONEP_COMBINE | "" (= kernel-tile table) | force "push" or "pull" combine |
| TRITONEP_GEOMETRY | "" (= kernel-tile table) | override kernel tile fields, e.g. ``bt=2,bh=512,warps=8,grid=128`` (benchmarks) |
| TRITONEP_CPU_HEAP_BYTES | 256 MiB | size of one rank's slice of the CPU (fork + mmap) symmetric heap |
| TRITONEP_FAST_LAUNCH | 1 | GPU launches of an already compiled kernel variant call the compiled kernel directly (``0``: always through ``kernel[grid]``) |
| TRITONEP_PACKED_LAUNCH | 1 | with TRITONEP_FAST_LAUNCH=1, a bound kernel's variant keeps its parameters packed once and a launch passes only its per-call values (:mod:`tritonep.runtime.packed_launch`; falls back to Triton's launcher where the C module cannot be built); ``0``: Triton's own C launcher with every argument |
| TRITONEP_OUTPUT_POOL | 3 | sets of per-call outputs a buffer reuses per CUDA stream once nobody holds them (triton backend: the handle storage and its views; on the decode tiles also the dispatch rows and the combine output; nccl backend: the sync-free dispatch's outputs of a decode-sized buffer, ``max_tokens_per_rank <= 256``), read at construction; ``0``: every call allocates (:mod:`tritonep.runtime.pool`). 3: a caller that holds the previous call's outputs and one more (a combine's handle) still gets pooled ones |
| TRITONEP_NCCL_SYNC_FREE | "" (= the rule) | the nccl backend's ``dispatch(sync_free=True)`` mode, read at construction (a field of the agreed config): ``gather`` (``all_gather`` of the counts, device plan, then the ``all_to_all_single``; every wire) or ``onehop`` (one ``all_to_all_single`` carrying the counts in a header slot, 2 launches; bf16 dispatch wire only); unset: the measured rule, one-hop for a bf16 buffer of ``max_tokens_per_rank <= 256`` (decode), gather otherwise (:mod:`tritonep.backends.nccl.sync_free`) |
| TRITONEP_FORCE_NO_P2P | 0 | ``1``: ``backend="auto"`` acts as if no rank could map its peers' memory and picks ``nccl`` (tests, debugging) |

Every option of the table is also an argument of the API (``tritonep.EPBuffer``: ``timeout_s``, ``num_sms``,
``tiles`` for TRITONEP_GEOMETRY and TRITONEP_COMBINE, ``sync_checks``, ``max_programs``, ``launch`` for
TRITONEP_FAST_LAUNCH / TRITONEP_PACKED_LAUNCH, ``output_pool``, ``sync_free_mode`` for TRITONEP_NCCL_SYNC_FREE,
``backend="nccl"`` for TRITONEP_FORCE_NO_P2P; ``tritonep.testing.run_cpu_world(heap_bytes=)`` for
TRITONEP_CPU_HEAP_BYTES): each function below takes the argument's value, and the variable is read only when the
argument is None. A buffer reads them once, when its configuration is built (:func:`tritonep.ep.config.build_config`);
its calls read nothing, so changing a variable changes the buffers built after it.

This module is also the only one that touches the process environment at all (``os.environ``; checked by
``tests/package/test_layering.py``): :func:`get` / :func:`put` / :func:`pop` / :func:`environ` for what is not a
tritonep option (``TRITON_INTERPRET``, the launcher's ``LOCAL_RANK``, a spawned rank's environment).
"""

from __future__ import annotations

import os

__all__ = ["timeout_s", "sync_checks", "SYNC_NONE", "SYNC_DEFERRED", "SYNC_STRICT", "num_sms", "max_programs",
           "combine_kind", "geometry_override", "cpu_heap_bytes", "force_no_p2p", "interpret", "fast_launch",
           "packed_launch", "launch", "LAUNCH_MODES", "output_pool", "nccl_sync_free", "VARIABLES", "snapshot",
           "check_all", "get", "put", "pop", "environ", "local_rank"]

VARIABLES = ("TRITONEP_TIMEOUT_S", "TRITONEP_SYNC_CHECKS", "TRITONEP_NUM_SMS", "TRITONEP_MAX_PROGRAMS",
             "TRITONEP_COMBINE", "TRITONEP_GEOMETRY", "TRITONEP_CPU_HEAP_BYTES", "TRITONEP_FAST_LAUNCH",
             "TRITONEP_PACKED_LAUNCH", "TRITONEP_FORCE_NO_P2P", "TRITONEP_OUTPUT_POOL", "TRITONEP_NCCL_SYNC_FREE")
"""Every variable of the table above (``tritonep env`` shows the ones that are set)."""


def _get(name: str, default: str | None) -> str | None:
    return os.environ.get(name, default)


def interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def timeout_s() -> float:
    """Default bound of every in-kernel wait in seconds (TRITONEP_TIMEOUT_S, default 300).

    Long enough for one rank to reach the next MoE layer minutes after another (checkpoint writing, evaluation on
    rank 0); EPBuffer / MoELayer take ``timeout_s=`` per object.

    Raises:
        ConfigError: not a positive, finite number.
    """
    v = _get("TRITONEP_TIMEOUT_S", "300")
    try:
        s = float(v)
    except ValueError:
        s = None
    if s is None or not 0 < s < float("inf"):
        from .errors import ConfigError

        raise ConfigError(f"TRITONEP_TIMEOUT_S={v!r}: use a positive number of seconds (default 300)")
    return s


SYNC_NONE, SYNC_DEFERRED, SYNC_STRICT = 0, 1, 2
_SYNC_NAMES = {"0": SYNC_NONE, "false": SYNC_NONE, "off": SYNC_NONE, "none": SYNC_NONE,
               "1": SYNC_STRICT, "true": SYNC_STRICT, "on": SYNC_STRICT, "strict": SYNC_STRICT,
               "": SYNC_DEFERRED, "deferred": SYNC_DEFERRED, "auto": SYNC_DEFERRED}


def sync_checks(value=None) -> int:
    """Host reads of eager calls: ``SYNC_NONE`` (0), ``SYNC_DEFERRED`` (the default) or ``SYNC_STRICT``; see the
    module table. ``value``: the API's (``EPBuffer(sync_checks=...)``: one of the three ints, or ``"none"`` /
    ``"deferred"`` / ``"strict"`` and the variable's spellings); None: TRITONEP_SYNC_CHECKS.

    Raises:
        ConfigError: another value (named).
    """
    if value in (SYNC_NONE, SYNC_DEFERRED, SYNC_STRICT) and not isinstance(value, bool):
        return value
    name = "TRITONEP_SYNC_CHECKS" if value is None else "sync_checks"
    raw = _get("TRITONEP_SYNC_CHECKS", "deferred") if value is None else value
    mode = _SYNC_NAMES.get(raw.strip().lower()) if isinstance(raw, str) else None
    if mode is None:
        from .errors import ConfigError

        raise ConfigError(f"{name}={raw!r}: use 0 (none), deferred (the default) or 1 (strict)")
    return mode


def _int_env(name: str, default: str, minimum: int, value=None, arg: str = "") -> int:
    """``value`` (the API's: an int >= ``minimum``, named ``arg`` in the error) or, when None, ``int(os.environ[name])``
    (default ``default``), at least ``minimum``; ConfigError naming the value."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            from .errors import ConfigError

            raise ConfigError(f"{arg}={value!r}: use an integer >= {minimum} (or None: {name})")
        return value
    v = _get(name, default)
    try:
        n = int(v.strip())
    except ValueError:
        n = None
    if n is None or n < minimum:
        from .errors import ConfigError

        raise ConfigError(f"{name}={v!r}: use an integer >= {minimum}")
    return n


def num_sms(value=None) -> int:
    """Cap on programs per communication kernel; 0 means: take the kernel-tile table's value. ``value``: the API's
    (``EPBuffer(num_sms=...)``; None or 0: TRITONEP_NUM_SMS).

    Raises:
        ConfigError: not an integer >= 0.
    """
    return _int_env("TRITONEP_NUM_SMS", "0", 0, value or None, "num_sms")


def max_programs(value=None) -> int:
    """Per-process cap on the programs of every kernel that waits on another rank; 0 means none
    (TRITONEP_MAX_PROGRAMS).

    Ranks that share one GPU under MPS run their kernels at the same time: a kernel spinning on a peer's flag holds
    its SMs, so every waiting grid of every rank must fit on the chip together, or a peer's kernel never gets the
    SMs it needs to raise the flag (docs/platform.md, "Several ranks on one GPU"). The kernel tiles, the counts exchange
    and the expert transport clip their grids to it; :mod:`tritonep.runtime.launch`'s bound launches refuse a larger grid.

    ``value``: the API's (``EPBuffer(max_programs=...)``); None: TRITONEP_MAX_PROGRAMS.

    Raises:
        ConfigError: not an integer >= 0.
    """
    return _int_env("TRITONEP_MAX_PROGRAMS", "0", 0, value, "max_programs")


def output_pool(value=None) -> int:
    """Sets of per-call outputs a buffer reuses per stream (default 3; 0 = off; :class:`tritonep.runtime.pool.
    OutputPool`). ``value``: the API's (``EPBuffer(output_pool=...)``); None: TRITONEP_OUTPUT_POOL.

    Raises:
        ConfigError: not an integer >= 0.
    """
    return _int_env("TRITONEP_OUTPUT_POOL", "3", 0, value, "output_pool")


def snapshot() -> dict:
    """``{name: value}`` of every variable of the table that is set in this process (what a spawned rank needs to
    see the same configuration)."""
    return {name: os.environ[name] for name in VARIABLES if name in os.environ}


def nccl_sync_free(value=None) -> str:
    """How a sync-free dispatch exchanges its counts on a backend that has two ways (the nccl backend's sync-free
    mode): "onehop", "gather" or "" (the default: the rule of :func:`tritonep.backends.nccl.sync_free.
    sync_free_mode`). ``value``: the API's (``EPBuffer(sync_free_mode=...)``); None: TRITONEP_NCCL_SYNC_FREE.

    Raises:
        ConfigError: any other value.
    """
    name = "TRITONEP_NCCL_SYNC_FREE" if value is None else "sync_free_mode"
    v = (_get("TRITONEP_NCCL_SYNC_FREE", "") if value is None else value)
    v = v.strip() if isinstance(v, str) else v
    if v not in ("", "onehop", "gather"):
        from .errors import ConfigError

        raise ConfigError(f"{name}={v!r}: use onehop, gather or leave it unset")
    return v


def combine_kind() -> str:
    """Forced combine kind, "push" or "pull", or "" for the kernel-tile table's choice (TRITONEP_COMBINE).

    Raises:
        ConfigError: any other value.
    """
    v = _get("TRITONEP_COMBINE", "")
    if v.strip() not in ("", "push", "pull"):
        from .errors import ConfigError

        raise ConfigError(f"TRITONEP_COMBINE={v!r}: use push, pull or leave it unset")
    return v.strip()


def geometry_override() -> str:
    """Comma-separated ``field=value`` overrides of the kernel tiles (TRITONEP_GEOMETRY); "" = none.

    Fields: ``bt``, ``bh``, ``warps``, ``grid`` (every data-kernel grid), ``combine``, ``fs``/``fe`` (fused
    dispatch roles), ``fc`` (fused combine), ``dec`` (one-launch decode dispatch and combine with that many programs,
    ``max_tokens_per_rank <= 256``), ``cbt``/``cwarps`` (the combine's tile), ``pf`` (the expander's prefetch),
    ``bbt``/``bwarps``/``bgrid`` (the combine backward's expand), ``hg`` (chunk-histogram programs), ``xeb``/``xw``
    (the counts exchange's experts per tile, the warps of both count kernels). Used by the benchmark to
    measure kernel-tile variants; it must be identical on every rank (EPBuffer's cross-rank config check covers it).
    """
    return _get("TRITONEP_GEOMETRY", "")


def cpu_heap_bytes() -> int:
    """Bytes of one rank's slice of the CPU symmetric heap (TRITONEP_CPU_HEAP_BYTES).

    Raises:
        ConfigError: not an integer >= 1.
    """
    return _int_env("TRITONEP_CPU_HEAP_BYTES", str(256 << 20), 1)


def _flag(name: str, default: str, empty_ok: bool = False) -> bool:
    """A 0 / 1 variable (``empty_ok``: an empty value means 0). Raises ConfigError for anything else."""
    v = _get(name, default).strip()
    if v not in ("0", "1") and not (empty_ok and v == ""):
        from .errors import ConfigError

        raise ConfigError(f"{name}={v!r}: use 0 or 1")
    return v == "1"


def fast_launch() -> bool:
    """Cached direct launches of compiled kernel variants on the GPU (TRITONEP_FAST_LAUNCH, default 1).

    Raises:
        ConfigError: a value other than 0 / 1.
    """
    return _flag("TRITONEP_FAST_LAUNCH", "1")


def packed_launch() -> bool:
    """Packed launches of bound kernel variants (TRITONEP_PACKED_LAUNCH, default 1; only with
    TRITONEP_FAST_LAUNCH=1 on the GPU).

    Raises:
        ConfigError: a value other than 0 / 1.
    """
    return _flag("TRITONEP_PACKED_LAUNCH", "1")


LAUNCH_MODES = ("packed", "direct", "triton")
"""How a bound launch reaches the GPU (:mod:`tritonep.runtime.bound`): ``packed`` (the compiled variant's C entry
with its parameters packed once: the default), ``direct`` (the compiled kernel's own C launcher with every argument),
``triton`` (Triton's ``kernel[grid]`` every launch)."""


def launch(value=None) -> str:
    """One of :data:`LAUNCH_MODES`. ``value``: the API's (``EPBuffer(launch=...)``); None: TRITONEP_FAST_LAUNCH and
    TRITONEP_PACKED_LAUNCH (``0``: triton; ``1`` and ``0``: direct; ``1`` and ``1``: packed).

    Raises:
        ConfigError: another value, or a bad variable.
    """
    if value is None:
        return "triton" if not fast_launch() else "packed" if packed_launch() else "direct"
    if value not in LAUNCH_MODES:
        from .errors import ConfigError

        raise ConfigError(f"launch={value!r}: use one of {', '.join(LAUNCH_MODES)} (or None: the environment)")
    return value


def force_no_p2p() -> bool:
    """``backend="auto"`` acts as if no rank could map its peers' memory (TRITONEP_FORCE_NO_P2P, default 0).

    Raises:
        ConfigError: a value other than 0 / 1.
    """
    return _flag("TRITONEP_FORCE_NO_P2P", "0", empty_ok=True)


def check_all() -> None:
    """Parse every variable of the table that has a parser here, so a bad value is refused before any work starts
    (the ``tritonep`` command calls this first; TRITONEP_GEOMETRY's fields are parsed by the kernel-tile table,
    :func:`tritonep.backends.kernel_tiles`, which the command calls too).

    Raises:
        ConfigError: the first bad value, naming the variable, the value and what to use.
    """
    timeout_s()
    sync_checks()
    num_sms()
    max_programs()
    combine_kind()
    cpu_heap_bytes()
    fast_launch()
    packed_launch()
    force_no_p2p()
    output_pool()
    nccl_sync_free()


# ------------------------------------------------------------------------------------------- the process environment
def get(name: str, default: str | None = None) -> str | None:
    """The process environment's value of ``name`` (any variable, e.g. ``TRITON_INTERPRET``), or ``default``."""
    return os.environ.get(name, default)


def put(name: str, value: str) -> None:
    """Set ``name`` in the process environment (what a rank or a spawned process started from it sees)."""
    os.environ[name] = value


def pop(name: str) -> str | None:
    """Remove ``name`` from the process environment; its old value or None."""
    return os.environ.pop(name, None)


def environ():
    """The process environment itself (``os.environ``), for code that hands a whole environment to a child process
    or replaces it for a task (:mod:`tritonep.testing.gpu_rank`, :mod:`tritonep.testing.mps`)."""
    return os.environ


def local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (torchrun), 0 when unset."""
    return int(os.environ.get("LOCAL_RANK", "0"))
