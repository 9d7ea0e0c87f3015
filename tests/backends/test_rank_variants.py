"""The ranks of a world compile ONE variant of each kernel: the rank is a runtime kernel argument that Triton does not
specialise (``do_not_specialize``), never a ``tl.constexpr`` or a field of a constexpr bundle (``RowTile``).

A rank as a constexpr gives every rank its own compiled variants (a cold start of W ranks then compiles W times what
one rank does, docs/gpu.md); a rank as a plain int is still specialised by Triton on value 1 (a constant) and on
divisibility by 16 (rank 0), so ranks 0, 1 and 2 got three variants. The static check reads every kernel's
signature; the worlds key every launch as Triton's JIT cache does (:mod:`tests.support.variant_keys`) and compare
the ranks' keys.
"""

import importlib
import inspect
import pkgutil

import pytest

import tritonep


def _kernel_modules():
    """Every module of tritonep that holds @triton.jit functions (kernels/ folders and device/)."""
    out = []
    for m in pkgutil.walk_packages(tritonep.__path__, "tritonep."):
        if ".kernels." in m.name or m.name.startswith("tritonep.device."):
            out.append(importlib.import_module(m.name))
    return out


def _jit_functions():
    """``(module name, function name, jit object, python function)`` of every @triton.jit in the kernel modules."""
    seen = set()
    for mod in _kernel_modules():
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if fn is None or not callable(fn) or getattr(fn, "__module__", None) != mod.__name__ or id(obj) in seen:
                continue
            if type(obj).__name__ not in ("InterpretedFunction", "JITFunction"):
                continue
            seen.add(id(obj))
            yield mod.__name__, name, obj, fn


def _do_not_specialize(obj) -> list:
    kw = getattr(obj, "kwargs", None) or {}
    return list(kw.get("do_not_specialize", getattr(obj, "do_not_specialize", None)) or [])


def test_no_kernel_takes_the_rank_at_compile_time():
    """No @triton.jit parameter named rank is a constexpr, every launched kernel (``*_kernel``) that takes a rank
    lists it in ``do_not_specialize``, and the constexpr row-tile bundle carries no rank."""
    from tritonep.device.common import RowTile

    assert not [f for f in RowTile._fields if f.lower() == "rank"], RowTile._fields
    fns = list(_jit_functions())
    assert len(fns) > 50, "the kernel modules were not found"
    constexpr, specialised, with_rank = [], [], []
    for mod, name, obj, fn in fns:
        params = inspect.signature(fn).parameters
        for p in params.values():
            if p.name.lower() != "rank":
                continue
            with_rank.append(f"{mod}.{name}")
            if "constexpr" in str(p.annotation):
                constexpr.append(f"{mod}.{name}({p.name})")
            if name.endswith("_kernel") and p.name not in _do_not_specialize(obj):
                specialised.append(f"{mod}.{name}({p.name})")
    assert not constexpr, f"the rank is a compile-time constant in {constexpr}"
    assert not specialised, f"Triton specialises the rank (1 / multiple of 16) in {specialised}: add it to " \
                            f"do_not_specialize"
    assert len(with_rank) >= 20, with_rank  # the kernels and helpers that take it (a renamed parameter hides here)


def test_launch_keys_of_ranks_0_to_3_are_equal():
    """Triton's own cache key (:func:`tests.support.variant_keys.launch_key`) of one launch of every kernel that
    takes a rank, with the rank 0, 1, 2 and 3 and all else equal, is one key; a plain int would give three."""
    from tests.support.variant_keys import key_text, launch_key

    checked = []
    for mod, name, obj, fn in _jit_functions():
        params = inspect.signature(fn).parameters
        if not name.endswith("_kernel") or "rank" not in params:
            continue
        keys = set()
        for rank in range(4):
            args = [rank if n == "rank" else (p.default if p.default is not inspect.Parameter.empty else 2)
                    for n, p in params.items()]
            keys.add(key_text(launch_key(obj, args, {})))
        assert len(keys) == 1, f"{mod}.{name}: {len(keys)} variants for ranks 0..3"
        checked.append(name)
    assert {"dispatch_send_kernel", "dispatch_expand_kernel", "combine_partial_kernel", "combine_out_kernel",
            "exchange_kernel", "sync_free_plan_kernel", "onehop_recv_kernel", "route_unpack_kernel",
            "plan_kernel"} <= set(checked), checked


def _assert_one_variant_set(recs):
    from tests.support.variant_keys import count, variants_by_rank

    by = variants_by_rank(recs)
    assert sorted(by) == [0, 1, 2, 3], sorted(by)
    ref = set(by[0])
    for r, v in by.items():
        diff = sorted({k.split('"name": ')[1].split(",")[0] for k in set(v) ^ ref})
        assert set(v) == ref, f"rank {r} compiles other variants than rank 0 of {diff}"
    c = count(recs)
    assert c["distinct"] == c["per_rank"][0], c
    return c


def test_world_of_4_ranks_compiles_one_variant_set_layer():
    """The MoE layer of ``tritonep run`` (forward + backward) in a CPU world of 4 ranks: every rank launches the
    same variants (Triton's cache keys), so the 4 ranks together need one rank's."""
    from tests.support.variant_paths import record

    c = _assert_one_variant_set(record(4, ("layer",), timeout_s=300))
    assert c["per_rank"][0] >= 8, c


def test_world_of_4_ranks_compiles_one_variant_set_every_path():
    """As above over every path a GPU run compiles (benchmarks/probes/variant_count.py: the layer, an EPBuffer's
    two-kernel, fused and decode paths on every wire with both backwards, virtual experts, the nccl backend's Triton paths)."""
    from tests.support.variant_paths import record

    c = _assert_one_variant_set(record(4, timeout_s=1200))
    assert c["per_rank"][0] >= 60, c


def _gpu_compiled_world(group):
    """One EPBuffer per rank (two-kernel push and pull combine, both backwards, the fp8 wire kept quantized; its
    construction's dry run compiles every variant it can launch), then the cache keys of what Triton compiled."""
    import torch
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs
    from tests.support.variant_keys import compiled_keys

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    for wire in ("bf16", "fp8"):
        b = tep.EPBuffer(group, 16, 256, 32, 4, dispatch_wire=wire, combine_wire=wire)
        x, i, w = make_rank_inputs(rank, 20, 256, 16, 4, seed=2)
        d = b.dispatch(x.to(dev), i.to(dev), w.to(dev))
        b.combine(d.x, d.handle)
        b.check()
        b.close()
    return compiled_keys(dev.index)


@pytest.mark.gpu
def test_gpu_ranks_compile_one_variant_set(gpu_world, gpu_world_size):
    """On the GPU: Triton's JIT cache of every rank holds the same keys for every tritonep kernel (the rank is no
    part of any variant), so ranks sharing a Triton cache directory share every compiled file."""
    W = max(2, gpu_world_size)
    res = gpu_world(W, _gpu_compiled_world)
    assert res[0] and "tritonep.backends.triton.kernels.dispatch.dispatch_send_kernel" in res[0], sorted(res[0])
    for r, keys in enumerate(res[1:], 1):
        diff = sorted(k for k in set(keys) | set(res[0]) if keys.get(k) != res[0].get(k))
        assert not diff, f"rank {r} compiled other variants than rank 0 of {diff}"
