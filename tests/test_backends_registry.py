"""The backend registry and interface (tritonep.ep.backends): both backends satisfy EPBackend; auto prefers triton."""

import inspect

import pytest

from tritonep.ep.backends import BACKENDS, EPBackend, backend_names, build_backend
from tritonep.ep.nccl_backend import NcclEP
from tritonep.ep.triton_backend import TritonEP
from tritonep.errors import ConfigError

_MEMBERS = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd", "expert_out_buffer", "check", "close",
            "allocated_bytes", "geometry")


def test_registry_order_and_needs():
    assert backend_names() == ("triton", "nccl")
    assert BACKENDS["triton"].needs_peer_memory and not BACKENDS["nccl"].needs_peer_memory


@pytest.mark.parametrize("cls", [TritonEP, NcclEP])
def test_backend_classes_have_every_member(cls):
    for m in _MEMBERS:
        assert hasattr(cls, m), (cls, m)


def test_build_is_keyword_only_and_satisfies_protocol():
    import torch

    with pytest.raises(TypeError):
        build_backend("nccl", None, 0)
    ep = build_backend("nccl", group=None, rank=0, world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=4,
                       topk=2, expert_alignment=1, max_recv_tokens=64, device=torch.device("cpu"),
                       dtype=torch.bfloat16)
    assert isinstance(ep, EPBackend) and ep.name == "nccl" and ep.allocated_bytes == 0 and ep.geometry is None
    ep.close()
    for spec in BACKENDS.values():
        params = inspect.signature(spec.build).parameters.values()
        assert all(p.kind == p.KEYWORD_ONLY for p in params)


def test_unknown_backend_is_a_config_error():
    from tritonep.ep.buffer import _check_static

    with pytest.raises(ConfigError, match="'auto', 'triton', 'nccl'"):
        _check_static(2, 8, 64, 4, 2, "bf16", "bf16", 1, None, "rdma")
