"""The one predicate of the world-1 one-pass ("DIRECT") combine
(:func:`tritonep.backends.triton.calls.one_pass_combine`): its truth table, and the one input both combine paths could
have decided it from differently (the expert output's dtype against the buffer's) held equal at the front door: a
world-1 buffer refuses a float32 expert output on the staged and the decode tiles, before any launch."""

from types import SimpleNamespace

import pytest
import torch

import tritonep as tep
from tritonep.backends.triton.calls import one_pass_combine
from tritonep.bench.cases import make_rank_inputs
from tritonep.errors import InputError
from tritonep.testing import run_cpu_world
from tritonep.wire.formats import WIRES, get_wire

from tests.support.hooks import backend_of


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["push", "pull"])
@pytest.mark.parametrize("wgrad", [False, True])
def test_one_pass_combine_exactly_world1_bf16_raw_push_no_wgrad(wire, world, kind, wgrad):
    codec = get_wire(wire).codec
    for dtype in (torch.bfloat16, torch.float32):
        cfg = SimpleNamespace(world_size=world, dtype=dtype)
        want = world == 1 and dtype == torch.bfloat16 and wire == "bf16" and kind == "push" and not wgrad
        assert one_pass_combine(cfg, codec, kind, wgrad) is want, (wire, world, kind, wgrad, dtype)


def _fp32_expert_out_world(group, geometry):
    import os

    os.environ["TRITONEP_GEOMETRY"] = geometry
    E, H, T, K = 4, 64, 5, 2
    buf = tep.EPBuffer(group, E, H, 8, K)
    x, idx, w = make_rank_inputs(0, T, H, E, K, seed=2)
    d = buf.dispatch(x, idx, w)
    try:
        buf.combine(d.x.float(), d.handle)
        refused = "accepted"
    except InputError as e:
        refused = str(e)
    y = buf.combine(d.x, d.handle)  # the buffer still combines (the refusal launched nothing)
    tiles = backend_of(buf).cfg.tiles
    buf.close()
    return refused, tuple(y.shape), y.dtype, tiles.decode > 0


@pytest.mark.parametrize("geometry", ["bt=2", "bt=2,dec=3"])
def test_world1_combine_refuses_a_float32_expert_out(geometry):
    refused, shape, dtype, decode = run_cpu_world(1, _fp32_expert_out_world, geometry, timeout_s=120)[0]
    assert "float32" in refused and "bfloat16" in refused, refused
    assert shape == (5, 64) and dtype == torch.bfloat16
    assert decode == ("dec=" in geometry)
