"""torchtitan 0.3.0 under torch 2.11 (tritonep/testing/torchtitan_compat.py).

* The DeepSeek-V3 MoE layer configs built from ``torchtitan.models.common`` classes equal torchtitan's own
  (``deepseekv3_configs[flavor](...).layers[i].moe``) field by field, initialisers included (a ``partial`` by its
  function, args and keywords), for debugmodel / 16B / 671B at their first, a middle and the last MoE layer.
* ``benchmarks/titan_bench.py --cpu`` (2-rank CPU world, debugmodel layer) and examples/torchtitan_moe.py's
  ``main`` (2 ranks, 4 steps) run in one process where torch 2.13 is made to look like torch 2.11 to torchtitan:
  ``torch.distributed.fsdp.DataParallelMeshDims`` and ``torch.compiler._is_non_strict_tracing`` deleted before
  torchtitan is imported (~20 s in all). Their checks must pass as on 2.13, and in that process ``import
  torchtitan.models.deepseek_v3`` must fail (the emulation bites).

CI installs torchtitan (scripts/setup.sh), so there these tests never skip; elsewhere they skip without torchtitan.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest

if os.environ.get("CI"):
    import torchtitan  # noqa: F401  (CI must run these tests)
else:
    pytest.importorskip("torchtitan")

from tests import ROOT  # noqa: E402
from tritonep.errors import ConfigError  # noqa: E402
from tritonep.testing.torchtitan_compat import DEEPSEEK_V3_MOE, deepseek_v3_moe_config  # noqa: E402

# Python run by the emulation test: torch 2.11's view of the two names, then the torchtitan example's main() in a
# 2-rank CPU world and the benchmark's CPU smoke, then proof that the removed name really blocks torchtitan's
# deepseek_v3 package in this process.
AS_TORCH_211 = """
import json, sys
import torch, torch.compiler, torch.distributed.fsdp as fsdp
assert not any(m.startswith("torchtitan") for m in sys.modules)
del fsdp.DataParallelMeshDims
del torch.compiler._is_non_strict_tracing
import runpy
from tritonep.testing import run_cpu_world
losses = run_cpu_world(2, runpy.run_path("examples/torchtitan_moe.py")["main"], timeout_s=300)  # needs no shim
sys.path.insert(0, "benchmarks")
import titan_bench
rc = titan_bench.main(["--cpu"])  # defines torch.compiler._is_non_strict_tracing (AllToAll calls it)
assert "torchtitan.models.deepseek_v3" not in sys.modules
try:
    import torchtitan.models.deepseek_v3
    blocked = ""
except ImportError as e:
    blocked = str(e)
print("RESULT " + json.dumps(dict(rc=rc, losses=losses, blocked=blocked)))
"""


def _diff(a, b, path="moe"):
    """Every difference between two torchtitan config trees (dataclasses, dicts, lists, partials, values)."""
    if type(a) is not type(b):
        return [f"{path}: type {type(a).__qualname__} != {type(b).__qualname__}"]
    if dataclasses.is_dataclass(a):
        return [d for f in dataclasses.fields(a) for d in _diff(getattr(a, f.name), getattr(b, f.name),
                                                                  f"{path}.{f.name}")]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, functools.partial):
        return _diff((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), f"{path}.partial")
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _torchtitans():
    try:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs
    except ImportError as e:  # torch 2.11: the very reason for the compat config
        if os.environ.get("CI"):
            raise
        pytest.skip(f"torchtitan's deepseek_v3 package does not import on this torch: {e}")
    return deepseekv3_configs


@pytest.mark.parametrize("flavor", sorted(DEEPSEEK_V3_MOE))
def test_moe_config_equals_torchtitans_field_by_field(flavor):
    configs = _torchtitans()
    model = configs[flavor](attn_backend="flex", moe_comm_backend="standard")
    first, n = DEEPSEEK_V3_MOE[flavor]["n_dense_layers"], len(model.layers)
    assert model.layers[first - 1].moe is None and model.layers[first].moe is not None  # first MoE layer as stated
    for layer_id in (first, (first + n) // 2, n - 1):
        ours = deepseek_v3_moe_config(flavor, layer_id)
        assert _diff(ours, model.layers[layer_id].moe) == [], (flavor, layer_id)
    assert not _diff(deepseek_v3_moe_config(flavor), deepseek_v3_moe_config(flavor, first))  # default: first MoE
    # the comparison can fail: a depth-scaled init of another layer differs
    assert _diff(deepseek_v3_moe_config(flavor, first), model.layers[n - 1].moe)


def test_moe_config_bad_flavor_or_dense_layer():
    with pytest.raises(ConfigError, match="'671b'"):
        deepseek_v3_moe_config("671b")
    with pytest.raises(ConfigError, match="layer_id=2 "):
        deepseek_v3_moe_config("671B", 2)
    with pytest.raises(ConfigError, match="layer_id=6 "):
        deepseek_v3_moe_config("debugmodel", 6)


def test_moe_config_num_experts_sized_to_a_card():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import titan_bench

    cfg = deepseek_v3_moe_config("671B", num_experts=128)
    full = deepseek_v3_moe_config("671B")
    assert (cfg.num_experts, cfg.router.num_experts, cfg.router.gate.out_features,
            cfg.routed_experts.inner_experts.num_experts, cfg.routed_experts.token_dispatcher.num_experts) == (128,) * 5
    assert [d for d in _diff(cfg, full) if "experts" not in d and "out_features" not in d] == []  # nothing else
    with pytest.raises(ConfigError, match="num_experts=100 "):  # not a multiple of the 8 expert groups
        deepseek_v3_moe_config("671B", num_experts=100)
    with pytest.raises(ConfigError, match="num_experts=4 "):  # fewer than top-8
        deepseek_v3_moe_config("671B", num_experts=4)
    GB = 10 ** 9
    assert titan_bench.experts_for_card("671b", 1, 80 * GB) == 128  # an H100: 128 x 176 MB = 22.5 GB <= 40
    assert titan_bench.experts_for_card("671b", 1, 141 * GB) == 256  # an H200 holds the whole layer
    assert titan_bench.experts_for_card("671b", 2, 80 * GB) == 256  # EP over two cards: half each
    assert titan_bench.experts_for_card("671b", 1, 1 * GB) == 8  # never below top-k / the expert groups


def test_titan_bench_verdict_blames_a_peer_only_when_alltoall_agrees():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import titan_bench

    def row(name, gw, y=0.0):
        return dict(dispatcher=name, y_err_vs_tritonep=y, gx_err_vs_tritonep=0.0, gw_err_vs_tritonep=gw,
                    checked=max(y, gw) <= titan_bench.TOL)

    rows = [row("tritonep", 0.0), row("minimal_async_ep", 1.1), row("alltoall", 0.0)]
    assert titan_bench.verdict(rows)  # the peer alone is off: its row says so, the run passes
    assert rows[1]["note"] == "gw differ from tritonep's and from AllToAll's (which equals tritonep's)"
    assert "note" not in rows[0] and "note" not in rows[2]
    rows = [row("tritonep", 0.0), row("minimal_async_ep", 0.0), row("alltoall", 1.1)]
    assert not titan_bench.verdict(rows)  # the reference disagrees with tritonep: the run fails
    assert "note" not in rows[1]
    rows = [dict(row("tritonep", 0.0), checked=False), row("alltoall", 0.0)]  # tritonep's row failed
    assert not titan_bench.verdict(rows)
    failed = dict(dispatcher="minimal_async_ep", eager_step_us="failed: RuntimeError", checked=False)
    assert titan_bench.verdict([row("tritonep", 0.0), failed, row("alltoall", 0.0)])  # a peer that cannot run here


@pytest.mark.slow  # 13 s: CI second step
def test_titan_bench_and_example_as_on_torch_211():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", AS_TORCH_211], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.rsplit("RESULT ", 1)[1])
    assert "DataParallelMeshDims" in result["blocked"], "the emulation did not remove the torch 2.13 name"
    assert result["rc"] == 0, p.stdout[-3000:]
    printed = json.JSONDecoder().raw_decode(p.stdout, p.stdout.index("[\n"))[0]  # the bench's rows (first print)
    rows = {r["dispatcher"]: r for r in printed}
    assert rows["tritonep"]["checked"] and rows["alltoall"]["checked"], rows
    assert isinstance(rows["alltoall"]["eager_step_us"], float), rows["alltoall"]  # AllToAll ran, not failed
    assert "symmetric-memory CUDA backend" in rows["minimal_async_ep"]["eager_step_us"], rows  # CUDA only
    losses = result["losses"]  # the example's main asserted its loss fell; both ranks see the all-reduced loss
    assert len(losses) == 2 and losses[0] == losses[1] and losses[0][-1] < losses[0][0]
