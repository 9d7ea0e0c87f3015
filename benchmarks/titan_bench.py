"""The torchtitan layer: torchtitan's MoE layer, forward + backward, with tritonep's token dispatcher vs torchtitan's
MinimalAsyncEP and AllToAll dispatchers: same module, same weights, same inputs, same run; outputs cross-checked;
eager and compiled.

    torchrun --nproc-per-node 1 benchmarks/titan_bench.py --json $OUT/titan_bench.json
    torchrun --nproc-per-node 2 benchmarks/titan_bench.py ...   # 2 GPUs; ranks sharing one GPU: docs/gpu.md

The layer is torchtitan 0.3.0's ``MoE`` configured as DeepSeek-V3 671B's MoE layer (torchtitan's own flavor, as
:func:`tritonep.testing.torchtitan_compat.deepseek_v3_moe_config` builds it: sigmoid router with groups, 1 shared
expert), bf16 weights, experts sharded over the EP group
(:func:`tritonep.integrations.torchtitan.shard_routed_experts`); ``--layer 16b`` takes DeepSeek 16B's flavor. One module is built once; each dispatcher is swapped in as
``moe.routed_experts.token_dispatcher`` (wired to the same EP mesh), so nothing but the dispatcher differs. The layer
is sized to the card as EP spreads it (:func:`experts_for_card`, or ``--num-experts``): DeepSeek-V3's 256 routed
experts at world 1 need 45 GiB of weights and gradients, so an 80 GB H100 runs 128 of them (same dim, top-k, groups
and token counts; every row records ``num_experts``).

Per tokens-per-rank point (``--tokens``, default 128 4096) and dispatcher: a step = ``moe(x)``, ``(y * g).sum()
.backward()``; eager time = median over 3 rounds of ``--iters`` steps (CUDA events); compiled =
``torch.compile(moe, fullgraph=True)`` (inductor), timed the same way after warm-up, or the reason it failed. Check:
``y``, ``x.grad`` and the routed-expert weight gradients of every dispatcher against tritonep's (relative max error <=
3e-2: bf16 expert GEMMs on the same rows, combine sums rounded differently). torchtitan's spmd backend is set to
``partial_dtensor`` so AllToAll runs its functional-collective path on the given mesh (the ``spmd_types`` path needs
torchtitan's full parallelize). Exit code 1 unless tritonep's row and AllToAll's check (:func:`verdict`).

Runs on torch 2.11 (the GPU machine's) as on 2.13: the layer config is built from ``torchtitan.models.common``
classes (torchtitan 0.3.0's ``deepseek_v3`` package imports ``DataParallelMeshDims``, absent in 2.11), and
``torch.compiler._is_non_strict_tracing``, which AllToAll's eager dispatch calls and 2.11 lacks, is defined as False
(:mod:`tritonep.testing.torchtitan_compat`; rows list it in ``torch_names_added``).
tests/integrations/test_torchtitan_compat.py runs ``--cpu`` with both names removed from torch 2.13.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tritonep as tep  # noqa: E402

TOL = 3e-2


FLAVORS = {"671b": "671B", "16b": "16B", "debug": "debugmodel"}


def moe_config(layer: str, num_experts: int | None = None):
    """The first MoE layer's config of that DeepSeek-V3 flavor, built from ``torchtitan.models.common`` classes
    (:func:`tritonep.testing.torchtitan_compat.deepseek_v3_moe_config`; torchtitan 0.3.0's ``deepseek_v3`` package
    does not import on torch 2.11), with ``num_experts`` routed experts (None: the flavor's)."""
    from tritonep.testing.torchtitan_compat import deepseek_v3_moe_config

    return deepseek_v3_moe_config(FLAVORS[layer], num_experts=num_experts)


def experts_for_card(layer: str, world_size: int, card_bytes: int) -> int:
    """Routed experts of the layer sized to the card as EP spreads it (:func:`tritonep.bench.sizing.experts_for_card`:
    this rank's experts' bf16 weights and gradients within half the card; at least top-k and the expert groups).
    DeepSeek-V3 671B at world 1: 256 experts need 45 GB, so an 80 GB H100 takes 128, a 141 GB H200 all 256."""
    from tritonep.bench.sizing import experts_for_card as fit
    from tritonep.testing.torchtitan_compat import DEEPSEEK_V3_MOE

    c = DEEPSEEK_V3_MOE[FLAVORS[layer]]
    return fit(c["num_experts"], 2 * 3 * c["dim"] * c["moe_hidden_dim"] * 2, world_size, card_bytes,
               min_experts=max(c["top_k"], c["num_expert_groups"] or 1))


def dispatchers(moe_cfg, T, dev, mesh):
    """name -> a factory of a wired dispatcher of that kind for this layer."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, MinimalAsyncEPTokenDispatcher

    from tritonep.integrations.torchtitan import TritonEPTokenDispatcher

    E, K = moe_cfg.num_experts, moe_cfg.router.top_k
    D = moe_cfg.routed_experts.inner_experts.dim

    def wired(cfg):
        d = cfg.build()
        d.wire_meshes(ep_mesh=mesh)
        return d

    return {
        "tritonep": lambda: wired(TritonEPTokenDispatcher.Config(num_experts=E, top_k=K, hidden_dim=D,
                                                                 num_max_tokens_per_rank=T)),
        "minimal_async_ep": lambda: wired(MinimalAsyncEPTokenDispatcher.Config(
            num_experts=E, top_k=K, hidden_dim=D, num_max_tokens_per_rank=T, dtype=torch.bfloat16, device=dev)),
        "alltoall": lambda: wired(AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)),
    }


def time_rounds(run, group, iters, rounds=3):
    """Median over ``rounds`` of (CUDA-event time of ``iters`` back-to-back ``run()`` calls) / iters, microseconds;
    the ranks start each round together (a device sync and a host barrier: works on gloo and NCCL groups)."""
    times = []
    for _ in range(rounds):
        if not torch.cuda.is_available():  # the CPU smoke run: wall time
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            times.append((time.perf_counter() - t0) * 1e6 / iters)
            continue
        torch.cuda.synchronize()
        dist.barrier(group=group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def verdict(rows) -> bool:
    """Whether tritonep's layer is right: its row ran and torchtitan's AllToAll dispatcher (the reference: plain
    all-to-all, no symmetric buffers) agrees with it on ``y``, ``x.grad`` and the weight gradient. A peer that
    disagrees while AllToAll agrees is the peer's result, not ours: its row keeps ``checked: false`` and gets a
    ``note`` naming what differs (on an H100, torchtitan 0.3.0's MinimalAsyncEP returns the routed experts' w1
    gradient 1.1 relative off both tritonep's and AllToAll's, with ``y`` and ``x.grad`` equal)."""
    by = {r["dispatcher"]: r for r in rows}
    ref = by.get("alltoall")
    ok = bool(by.get("tritonep", {}).get("checked")) and (ref is None or bool(ref.get("checked")))
    for r in rows:
        if r["dispatcher"] in ("tritonep", "alltoall") or r.get("checked") or not ok or "y_err_vs_tritonep" not in r:
            continue
        off = [k for k in ("y", "gx", "gw") if r[f"{k}_err_vs_tritonep"] > TOL]
        r["note"] = (f"{'/'.join(off)} differ from tritonep's"
                     + (" and from AllToAll's (which equals tritonep's)" if ref is not None else ""))
    return ok


def bench_point(group, mesh, layer, T, iters, compile_too, num_experts=None):
    from tritonep.integrations.torchtitan import close_buffers, shard_routed_experts

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = moe_config(layer, num_experts)
    torch.manual_seed(0)  # the same weights on every rank
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # bf16 weights (the grouped GEMMs run in bf16 anyway); fp32 buffers
    try:
        with torch.device(dev):
            moe = cfg.build()
            moe.init_states(buffer_device=dev)
    finally:
        torch.set_default_dtype(default)
    shard_routed_experts(moe, mesh)  # slices the experts; wires the Local dispatcher (replaced below)
    D = cfg.routed_experts.inner_experts.dim
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    x0 = torch.randn(1, T, D, generator=g).to(dev, torch.bfloat16)
    gy = torch.randn(1, T, D, generator=g).to(dev, torch.bfloat16)
    experts = moe.routed_experts.inner_experts

    def step(fn):
        x = x0.clone().requires_grad_()
        y = fn(x)
        (y.float() * gy.float()).sum().backward()
        return y, x

    rows, results = [], {}
    for name, make in dispatchers(cfg, T, dev, mesh).items():
        row = dict(dispatcher=name, layer=layer, T=T, world_size=dist.get_world_size(group),
                   num_experts=cfg.num_experts)
        try:
            moe.routed_experts.token_dispatcher = make()
            moe.zero_grad(set_to_none=True)
            y, x = step(moe)
            _sync()
            # the weight gradient is compared to tritonep's at once (a copy per dispatcher would hold the experts'
            # w1 gradient three times: 22 GiB at 256 experts)
            got = dict(y=y.detach(), gx=x.grad)
            if "tritonep" in results:
                got["gw_err"] = _err(experts.w1_EFD.grad, results["tritonep"]["gw"])
            else:
                got["gw"] = experts.w1_EFD.grad.clone()
            results[name] = got
            del y, x
            row["eager_step_us"] = time_rounds(lambda: step(moe), group, iters)
        except Exception as e:  # noqa: BLE001 - a dispatcher that cannot run here is a result
            row["eager_step_us"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            _sync()
        if compile_too and name in results:
            try:
                torch._dynamo.reset()
                comp = torch.compile(moe, fullgraph=True)
                for _ in range(2):
                    step(comp)
                row["compiled_step_us"] = time_rounds(lambda: step(comp), group, iters)
            except Exception as e:  # noqa: BLE001
                row["compiled_step_us"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                _sync()
        rows.append(row)
    ref = results.get("tritonep")
    for row in rows:
        got = results.get(row["dispatcher"])
        if ref is None or got is None:
            row["checked"] = False
            continue
        for k in ("y", "gx"):
            row[f"{k}_err_vs_tritonep"] = _err(got[k], ref[k])
        row["gw_err_vs_tritonep"] = got.get("gw_err", 0.0)  # tritonep's own row: 0 by definition
        row["checked"] = all(row[f"{k}_err_vs_tritonep"] <= TOL for k in ("y", "gx", "gw"))
    verdict(rows)
    base = {r["dispatcher"]: r.get("eager_step_us") for r in rows}
    for row in rows:
        if isinstance(base.get("tritonep"), float) and isinstance(row.get("eager_step_us"), float):
            row["eager_vs_tritonep"] = row["eager_step_us"] / base["tritonep"]
    close_buffers()
    from torchtitan.distributed.minimal_async_ep import api as mae

    mae._buffer_key = None  # MinimalAsyncEP keeps one process-global buffer: the next point sizes it anew
    mae._buffer_state = None
    return rows


def _cpu_world(group):
    """The CPU smoke run: debugmodel layer, 16 tokens per rank, eager only (MinimalAsyncEP needs CUDA: it fails)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size(group))))
    return bench_point(group, mesh, "debug", 16, 1, False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--layer", choices=["671b", "16b", "debug"], default="671b")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--num-experts", type=int, default=0,
                    help="routed experts of the layer (default 0: the flavor's count sized to the card, "
                         "experts_for_card: 128 of DeepSeek-V3's 256 on an 80 GB H100 at world 1)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu", action="store_true", help="smoke run of this script: 2-rank CPU world, debugmodel layer")
    args = ap.parse_args(argv)
    from tritonep.testing.torchtitan_compat import add_missing_torch_names

    shims = add_missing_torch_names()  # torch 2.11: AllToAll's eager dispatch calls a name it lacks
    if args.cpu:
        from tritonep.testing import run_cpu_world

        rows = run_cpu_world(2, _cpu_world, timeout_s=600)[0]
        print(json.dumps(rows, indent=1))
        return 0 if verdict(rows) else 1
    ndev = torch.cuda.device_count()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % ndev)
    W = int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("nccl" if W <= ndev else "gloo")  # NCCL refuses two ranks on one GPU
    group = dist.group.WORLD
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    torch._dynamo.config.capture_scalar_outputs = True  # what torchtitan's apply_compile sets for MoE dispatch
    mesh = DeviceMesh("cuda", list(range(W)))
    rows = []
    E = args.num_experts or experts_for_card(args.layer, W, torch.cuda.get_device_properties(0).total_memory)
    for T in args.tokens:
        for row in bench_point(group, mesh, args.layer, T, args.iters, not args.no_compile, E):
            row.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, tritonep=tep.__version__,
                       torch_names_added=shims)
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
        if args.json and dist.get_rank() == 0:  # after every point: a run stopped at its time limit keeps its rows
            from tritonep.bench.meta import run_meta

            with open(args.json, "w") as f:
                json.dump(dict(meta=run_meta(world_size=dist.get_world_size()), rows=rows), f, indent=1)
    dist.destroy_process_group()
    points = {}
    for r in rows:
        points.setdefault(r["T"], []).append(r)
    return 0 if all(verdict(p) for p in points.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
