"""``tritonep env``: versions, devices, peer access and which EP backend ``auto`` would pick, and why."""

from __future__ import annotations

import platform

__all__ = ["add_parser", "collect_env", "INTERPRET_SET_BY_CLI"]

INTERPRET_SET_BY_CLI = "_TRITONEP_CLI_SET_INTERPRET"
"""Marker the command sets next to ``TRITON_INTERPRET=1`` when it chose the interpreter itself (no GPU), so
``tritonep env`` does not report the command's own choice as the user's setting."""


def add_parser(sub):
    p = sub.add_parser("env", help="print versions, devices, P2P access and the backend 'auto' would choose",
                       description="Prints one table: Python, torch, Triton and numpy versions, the GPUs, whether "
                                   "the multicast variables of a GPU run are set, the EP backend that "
                                   "EPBuffer(backend='auto') picks here and why, TRITONEP_TIMEOUT_S and "
                                   "TRITONEP_SYNC_CHECKS as in effect (their defaults when unset), and every other "
                                   "TRITONEP_* variable that is set (all of them: tritonep/envs.py). Starts no ranks; "
                                   "works without a GPU.")
    p.set_defaults(func=main)


def collect_env() -> dict:
    """A dict of what matters for tritonep on this machine (no process group needed)."""
    import numpy
    import torch
    import triton

    from .. import envs
    from ..ep.backend_choice import choose_from_reports

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "TRITON_INTERPRET": envs.get("TRITON_INTERPRET", "") + (
            " (set by the tritonep command: no GPU; in your own scripts run_cpu_world sets it if nothing imported "
            "tritonep's kernels or triton.language (import torch._dynamo does) before it, else start Python with "
            "TRITON_INTERPRET=1)"
            if envs.get(INTERPRET_SET_BY_CLI) else ""),
        "TRITONEP_TIMEOUT_S": envs.timeout_s(),
        "TRITONEP_SYNC_CHECKS": {envs.SYNC_NONE: "none", envs.SYNC_DEFERRED: "deferred",
                                 envs.SYNC_STRICT: "strict"}[envs.sync_checks()],
        "multicast_disabled": all(envs.get(k) == v for k, v in (
            ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))),
    }
    info.update({k: v for k, v in envs.snapshot().items() if k not in info})
    if info["gpus"]:
        n = info["gpus"]
        info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(n)]
        info["p2p"] = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n)
                       if i != j}
        all_p2p = all(info["p2p"].values()) if info["p2p"] else True
        why = ("every local GPU can map every other GPU's memory (one host)" if all_p2p else
               "some local GPUs cannot access each other's memory")
    else:
        all_p2p = True
        why = ("no GPU: CPU worlds share one fork+mmap heap, so every rank maps every peer (groups spanning hosts or "
               "TRITONEP_FORCE_NO_P2P=1 pick a backend that maps no peer memory; CPU processes outside a CPU world, "
               "e.g. under torchrun, have no shared heap: pass backend='nccl' on a gloo group)")
    if envs.force_no_p2p():
        all_p2p, why = False, "TRITONEP_FORCE_NO_P2P=1"
    # what "auto" picks for a group of ranks on this host that all see what this process sees
    report = dict(host="this host", device_type="cuda" if info["gpus"] else "cpu", p2p=all_p2p, why=why)
    info["backend_auto"], _ = choose_from_reports("auto", [report])
    info["backend_why"] = why
    return info


_NOTES = {
    ("multicast_disabled", False): (" (not all of NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
                                    "NVSHMEM_DISABLE_NVLS=1 are set: GPU runs want them, README 'Install on a GPU "
                                    "machine'; no effect on a CPU)"),
}
"""What a value means when the bare value does not say (``(key, value)`` -> a note printed after it)."""


def main(args) -> int:
    from rich.table import Table

    from .console import make_console

    t = Table(title="tritonep env")
    t.add_column("key")
    t.add_column("value")
    for k, v in collect_env().items():
        t.add_row(k, str(v) + _NOTES.get((k, v), ""))
    make_console().print(t)
    return 0
