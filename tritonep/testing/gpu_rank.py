"""The rank side of a GPU world (:mod:`tritonep.testing.gpu_world`): set up once (environment, device, process group),
then run every task the parent sends until it says stop. Each task runs with the parent's ``TRITONEP_*`` variables
of that moment; the rank's environment is put back after it."""

from __future__ import annotations

import gc
import os
import pickle
import sys
import traceback
from dataclasses import replace

from .. import envs
from . import interrupts
from .placement import GpuWorldInfo, programs_per_rank
from .world import _picklable

__all__ = ["gpu_world_info", "rank_main", "STOP"]

_RANK_INFO: GpuWorldInfo | None = None  # set in every rank process
STOP = pickle.dumps(("stop",))
"""The parent's message that ends a rank's task loop."""


def gpu_world_info() -> GpuWorldInfo | None:
    """In a rank of a GPU world: how the world runs (:class:`tritonep.testing.placement.GpuWorldInfo`); None
    elsewhere. A rank function can, e.g., skip a timing or lower a soak's length when ``info.shared``."""
    return _RANK_INFO


def _to_cpu(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _rank_setup(rank, info: GpuWorldInfo, env: dict, store_path: str):
    """Environment, device and process group of one rank; returns ``(group, device, ready-report)``."""
    global _RANK_INFO
    from .. import envs

    for name in envs.VARIABLES:  # the per-task snapshot of the parent sets these (see _task_env)
        envs.environ().pop(name, None)
    envs.environ().update(env)
    import torch
    import torch.distributed as dist

    dev = torch.device(info.devices[rank])
    report = {"max_programs": 0, "sms": 0}
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        report["sms"] = sms
        if info.mode == "mps":
            report["max_programs"] = programs_per_rank(sms, info.ranks_per_device)
            envs.environ()["TRITONEP_MAX_PROGRAMS"] = str(report["max_programs"])
    store = dist.FileStore(store_path, info.world_size)
    if info.backend == dist.Backend.NCCL:
        dist.init_process_group("nccl", store=store, rank=rank, world_size=info.world_size, device_id=dev)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=info.world_size)
    dist.barrier()  # the full mesh is connected on every rank before any rank may fail and exit
    _RANK_INFO = replace(info, max_programs=report["max_programs"])
    return dist.group.WORLD, dev, report


def _task_env(base: dict, parent: dict) -> dict:
    """The environment of one task: the rank's base plus the parent's TRITONEP_* snapshot; a world-set
    TRITONEP_MAX_PROGRAMS and the parent's combine to the smaller cap."""
    env = dict(base)
    env.update(parent)
    caps = [int(v) for v in (base.get("TRITONEP_MAX_PROGRAMS"), parent.get("TRITONEP_MAX_PROGRAMS"))
            if v not in (None, "", "0") and str(v).isdigit()]
    if caps:
        env["TRITONEP_MAX_PROGRAMS"] = str(min(caps))
    return env


def rank_main(rank, info, env, store_path, parent_pid, conn):
    """A rank: set up once, then run every task the parent sends until it says stop (or kills the rank)."""
    interrupts.rank_process_setup(parent_pid)
    status = 0
    try:
        try:
            group, dev, report = _rank_setup(rank, info, env, store_path)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
            conn.send_bytes(pickle.dumps(("err", rank, (type(e).__name__, str(e), traceback.format_exc(),
                                                        _picklable(e)))))
            status = 1
            return
        conn.send_bytes(pickle.dumps(("ready", rank, report)))
        base = dict(envs.environ())
        while True:
            raw = conn.recv_bytes()
            if raw == STOP:
                break
            out = reply = None
            try:
                _, fn, args, parent_env, path = pickle.loads(raw)  # imports fn's module: may fail like fn
                for p in reversed(path):
                    if p not in sys.path:
                        sys.path.insert(0, p)
                envs.environ().clear()
                envs.environ().update(_task_env(base, parent_env))
                out = fn(group, *args)
                if dev.type == "cuda":
                    import torch

                    torch.cuda.synchronize(dev)
                reply = pickle.dumps(("ok", rank, _to_cpu(out)))
            except BaseException as e:  # noqa: BLE001 - also a result that does not pickle
                reply = pickle.dumps(("err", rank, (type(e).__name__, str(e), traceback.format_exc(),
                                                    _picklable(e))))
            finally:
                envs.environ().clear()
                envs.environ().update(base)
            conn.send_bytes(reply)
            out = reply = None  # free the task's tensors before the next one
            gc.collect()
            if dev.type == "cuda":
                import torch

                torch.cuda.empty_cache()
        import torch.distributed as dist

        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent went away or killed the world
        status = 1
    finally:
        os._exit(status)
