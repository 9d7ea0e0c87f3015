"""Backend choice for ``backend="auto"``: the first registered backend (:mod:`tritonep.backends`) whose needs
every rank meets: triton when every rank can map every peer's memory, else nccl."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .. import envs
from ..errors import BackendError
from ..backends import BACKENDS

__all__ = ["choose_backend", "choose_from_reports", "p2p_report"]


def p2p_report(device: torch.device) -> dict:
    """This rank's view: host name, device type, and whether it can map every other local GPU."""
    forced = envs.force_no_p2p()
    info = {"host": socket.gethostname(), "device_type": device.type, "p2p": True, "why": ""}
    if forced:
        info.update(p2p=False, why="TRITONEP_FORCE_NO_P2P=1")
    elif device.type == "cuda":
        n = torch.cuda.device_count()
        bad = [j for j in range(n) if j != device.index and not torch.cuda.can_device_access_peer(device.index, j)]
        if bad:
            info.update(p2p=False, why=f"cuda:{device.index} cannot access peers {bad}")
    return info


def choose_backend(group, requested: str, device: torch.device):
    """Return ``(backend, reason)``; every rank computes the same answer from one all_gather of reports.

    Raises:
        BackendError: ranks requested different backends or sit on different device types, or the requested
            backend's needs are not met.
    """
    ws = dist.get_world_size(group)
    reports = [None] * ws
    dist.all_gather_object(reports, p2p_report(device), group=group)
    return choose_from_reports(requested, reports)


def choose_from_reports(requested: str, reports: list):
    """``(backend, reason)`` from every rank's :func:`p2p_report` (gathered by the caller; EPBuffer gathers them in
    its one constructor collective, :func:`tritonep.ep.config.agree`, which also checked that every rank asked for
    the same backend on the same device type).

    Raises:
        BackendError: ranks sit on different device types, or the requested backend needs every rank to map every
            peer's memory and some cannot.
    """
    ws = len(reports)
    types = {r["device_type"] for r in reports}
    if len(types) > 1:
        raise BackendError(f"ranks sit on different device types: {[r['device_type'] for r in reports]}")
    hosts = {r["host"] for r in reports}
    all_p2p = all(r["p2p"] for r in reports) and len(hosts) == 1
    if requested != "auto":
        if BACKENDS[requested].needs_peer_memory and not all_p2p:
            why = "; ".join(r["why"] for r in reports if r["why"]) or f"{len(hosts)} hosts"
            raise BackendError(f"backend={requested!r} needs every rank to map every peer's memory: {why}")
        return requested, "requested"
    for spec in BACKENDS.values():  # registry order = preference order
        if spec.needs_peer_memory and not all_p2p:
            continue
        if spec.needs_peer_memory:
            return spec.name, f"all {ws} ranks on one host ({next(iter(hosts))}) with peer access"
        if all_p2p:
            return spec.name, "first registered backend"
        why = "; ".join(r["why"] for r in reports if r["why"]) or f"group spans {len(hosts)} hosts"
        return spec.name, f"peer memory not mappable: {why}"
    raise BackendError("no registered backend can serve this group")
