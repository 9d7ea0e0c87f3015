"""The backend registry and interface (tritonep.backends): both backends satisfy EPBackend; auto prefers triton."""

import inspect

import pytest

from tritonep.backends import BACKENDS, EPBackend, backend_names, build_backend
from tritonep.backends.nccl.backend import NcclEP
from tritonep.backends.triton.backend import TritonEP
from tritonep.errors import ConfigError

_MEMBERS = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd", "expert_out_buffer", "check", "close",
            "allocated_bytes", "tiles", "sync_free", "counts_exchange", "expert_transport")


def test_registry_order_and_needs():
    assert backend_names() == ("triton", "nccl")
    assert BACKENDS["triton"].needs_peer_memory and not BACKENDS["nccl"].needs_peer_memory


@pytest.mark.parametrize("cls", [TritonEP, NcclEP])
def test_backend_classes_have_every_member(cls):
    for m in _MEMBERS:
        assert hasattr(cls, m), (cls, m)


def test_build_takes_the_config_whole_and_satisfies_protocol():
    import torch

    from tritonep.ep.config import EPConfig, build_config

    cfg = build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=4, topk=2, backend="nccl",
                       device_type="cpu")
    assert isinstance(cfg, EPConfig) and cfg.max_recv_tokens == 2 * 4 * 2 and cfg.num_local_experts == 4
    with pytest.raises(TypeError):
        build_backend("nccl", cfg, None, 0)  # group / rank / device are keyword-only
    ep = build_backend("nccl", cfg, group=None, rank=0, device=torch.device("cpu"))
    assert isinstance(ep, EPBackend) and ep.name == "nccl" and ep.allocated_bytes == 0 and ep.tiles is None
    assert ep.cfg is cfg  # handed whole: nothing re-spelled below the front door
    ep.close()
    for spec in BACKENDS.values():
        params = list(inspect.signature(spec.build).parameters.values())
        assert params[0].name == "cfg" and all(p.kind == p.KEYWORD_ONLY for p in params[1:])


def test_unknown_backend_is_a_config_error():
    from tritonep.backends import check_backend_name

    with pytest.raises(ConfigError, match="'auto', 'triton', 'nccl'"):
        check_backend_name("rdma")
    check_backend_name("auto")


# ------------------------------------------------------------------------------------------------ handles, services
def _handles_and_counts_world(group):
    """Rank body: a dispatch on each backend (frozen typed handles), and each backend's counts exchange on the same
    routing (ids outside [0, E) included, rank 1 with T=0), then a refused input on rank 0."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from tritonep import EPBuffer
    from tritonep.backends import CountsExchange, ExpertTransport
    from tritonep.backends.nccl.handle import NcclHandle
    from tritonep.backends.triton.handle import TritonHandle
    from tritonep.ep.handle import DispatchHandle
    from tritonep.errors import CapacityError, PeerInputError

    rank = dist.get_rank(group)
    T = 5 if rank == 0 else 0
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(-1, 8, (T, 2), generator=g)
    x, w = torch.randn(T, 32, generator=g).bfloat16(), torch.rand(T, 2, generator=g)
    out = {}
    for backend, cls in (("triton", TritonHandle), ("nccl", NcclHandle)):
        buf = EPBuffer(group, 8, 32, 6, 2, backend=backend, device="cpu")
        h = buf.dispatch(x, idx, w).handle
        assert type(h) is cls and isinstance(h, DispatchHandle) and h.backend == backend and h.buffer_id > 0
        assert not hasattr(h, "extras") and isinstance(h.counts, torch.Tensor)
        try:
            h.num_recv_rows = 0
            frozen = False
        except dataclasses.FrozenInstanceError:
            frozen = True
        cx = buf.counts_exchange()
        tr = buf.expert_transport(8, {"w1": (4, 4)})
        assert isinstance(cx, CountsExchange) and isinstance(tr, ExpertTransport)
        bad_idx = idx.clone()
        if rank == 1:
            bad_idx = torch.tensor([[9, -1]])  # an id outside [-1, E): flagged, not counted
        counts = [cx.gather(idx), cx.gather(bad_idx)]
        try:
            cx.check()
            flagged = "none"
        except PeerInputError as e:
            flagged = e.bad_ranks
        try:
            cx.gather(torch.zeros(7, 2, dtype=torch.int64) if rank == 0 else idx)  # 7 > max_tokens_per_rank
            refused = "none"
        except CapacityError:
            refused = "capacity"
        out[backend] = dict(frozen=frozen, counts=counts, hcounts=h.counts.clone(), flagged=flagged, refused=refused)
        tr.close()
        cx.close()
        buf.close()
    return out


def test_frozen_handles_and_counts_exchange_equal_on_both_backends():
    """Handles are frozen and typed per backend (no extras dict); both backends' counts exchanges (built through
    the buffer) give the same [W, E] matrix, flag ids outside [-1, E) for check(), and take part when refusing."""
    import torch

    from tritonep.testing import run_cpu_world

    res = run_cpu_world(2, _handles_and_counts_world, timeout_s=120)
    for r, out in enumerate(res):
        t, n = out["triton"], out["nccl"]
        assert t["frozen"] and n["frozen"]
        assert all(torch.equal(a, b) for a, b in zip(t["counts"], n["counts"]))
        assert torch.equal(t["hcounts"], n["hcounts"]) and torch.equal(t["hcounts"], t["counts"][0])
        assert t["flagged"] == n["flagged"] == [1], (t["flagged"], n["flagged"])
        assert t["refused"] == n["refused"] == ("capacity" if r == 0 else "none")
