"""Own-rank routes skip the staging copy on every wire whose codec does not stage them (quantized wires: the expander
encodes them itself); a codec with ``DeviceCodec.stage_own`` (none by default: the test sets it on mxfp4) stages them
like a peer's.

Each rank fills its own staging rows ``stage[RANK]`` with a sentinel before a world-2 dispatch and a combine
backward; the sentinel survives while every output is exact, and the peer's rows are staged (raw, or the twin
quantizer's bits on fp8 / mxfp4: :mod:`tests.support.staging_checks` states every check and tolerance). Paths: two kernels (CPU default geometry), the fused one-launch dispatch (``fs=1,fe=1``), the one-launch
decode dispatch (``bt=4,dec=3``); the GPU test runs the same checks on a GPU world of 2 at larger shapes (the
ranks share a GPU when there is one).
"""

import pytest
import torch

from tritonep.testing import run_cpu_world
from tests.support.staging_checks import check_own_staging, own_staging_world, stage_own_pair_world

CPU_CASE = dict(E=8, H=256, Tmax=12, K=3, A=2, T=[11, 6], seed=9)


def _geometry(monkeypatch, geometry):
    if geometry is None:
        monkeypatch.delenv("TRITONEP_GEOMETRY", raising=False)
    else:
        monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)


@pytest.mark.parametrize("wire,geometry", [("bf16", None), ("bf16", "fs=1,fe=1"), ("bf16", "bt=4,dec=3"),
                                           ("fp8", None), ("mxfp4", "fs=1,fe=1"), ("fp8", "bt=4,dec=3")])
def test_own_rank_rows_skip_staging_on_every_wire(monkeypatch, wire, geometry):
    _geometry(monkeypatch, geometry)
    res = run_cpu_world(2, own_staging_world, wire, CPU_CASE, timeout_s=300)
    check_own_staging(res, wire, CPU_CASE)


@pytest.mark.parametrize("geometry", [None, "fs=1,fe=1", "bt=4,dec=3"])
def test_own_rank_rows_staged_when_the_codec_says_so(monkeypatch, geometry):
    """mxfp4 with ``stage_own`` set: its own tokens routed to its own rank are staged (the twin's bytes) and the
    expander decodes them like a peer's; every output as the reference."""
    _geometry(monkeypatch, geometry)
    res = run_cpu_world(2, own_staging_world, "mxfp4", CPU_CASE, True, timeout_s=300)
    check_own_staging(res, "mxfp4", CPU_CASE, stage_own=True)


@pytest.mark.parametrize("world,geometry", [(1, None), (1, "fs=1,fe=1"), (1, "bt=4,dec=3"), (2, "fs=1,fe=1")])
def test_stage_own_gives_the_same_bits(monkeypatch, world, geometry):
    """mxfp4 with ``stage_own`` on and off: dispatched rows (decoded and kept quantized), weights, offsets, combine
    and combine backward equal bit for bit, at world 1 (where only a stage_own wire stages anything) and world 2."""
    _geometry(monkeypatch, geometry)
    case = dict(CPU_CASE, T=CPU_CASE["T"][:world])
    for r, (off, on) in enumerate(run_cpu_world(world, stage_own_pair_world, "mxfp4", case, timeout_s=300)):
        assert off.keys() == on.keys()
        for name in off:
            assert torch.equal(off[name].view(torch.uint8), on[name].view(torch.uint8)), (r, name)


GPU_CASES = [  # (wire, geometry, case): the table's geometry at a decode and a prefill size, forced fused/two-kernel
    ("bf16", None, dict(E=256, H=7168, Tmax=128, K=8, A=1, T=[128, 77], seed=3)),
    ("bf16", None, dict(E=256, H=7168, Tmax=1024, K=8, A=128, T=[1024, 600], seed=4)),
    ("bf16", "fs=0,fe=0", dict(E=256, H=7168, Tmax=1024, K=8, A=1, T=[1000, 1024], seed=5)),
    ("fp8", None, dict(E=256, H=7168, Tmax=1024, K=8, A=1, T=[1024, 513], seed=6)),
    ("mxfp4", "fs=16,fe=32", dict(E=64, H=2048, Tmax=512, K=6, A=1, T=[512, 0], seed=7)),
    ("mxfp4", None, dict(E=256, H=7168, Tmax=1024, K=8, A=1, T=[1024, 700], seed=8)),  # the table's 8-token tiles
]


@pytest.mark.gpu
@pytest.mark.parametrize("wire,geometry,case", GPU_CASES)
def test_gpu_own_rank_rows_skip_staging(gpu_world, monkeypatch, wire, geometry, case):
    _geometry(monkeypatch, geometry)
    res = gpu_world(2, own_staging_world, wire, case)  # the check is about one rank and its one peer: world 2
    check_own_staging(res, wire, case)
