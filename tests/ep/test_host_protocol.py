"""The host protocol rule (docs/protocols.md (host protocol rule)) on the CPU world: uneven per-rank token scripts
(0 included, changing every call) on both backends and several geometries, and the host reads each call makes in
each sync-check mode. The refusal side of the rule is in test_collective_errors.py, the recorder in
tests/testing/test_protocol_recorder.py."""

import os

import pytest
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, calls_world, check_calls, set_env
from tests.support.hooks import backend_of


# every call changes T on every rank, 0 and Tmax included; rank 1 starts with T=0 (data-parallel decode)
T_SCRIPT = {2: [[1, 0], [2, 0], [0, 3], [8, 8], [0, 0], [5, 1], [8, 0], [3, 7]],
            3: [[1, 0, 2], [0, 0, 8], [8, 3, 0], [2, 8, 1]]}


def _script_world(group, cfg, calls, geometry):
    set_env(TRITONEP_GEOMETRY=geometry or None)
    return calls_world(group, cfg, calls)


@pytest.mark.parametrize("W,backend,geometry", [(2, "triton", ""), (2, "triton", "fs=1,fe=1"), (3, "triton", ""),
                                                (2, "triton", "bt=2,dec=3"), (3, "triton", "bt=2,dec=2"),
                                                (2, "nccl", "")])
def test_per_rank_token_script(W, backend, geometry):
    cfg = dict(E=4 * W, H=64, Tmax=8, K=4, backend=backend)
    calls = [[make_rank_inputs(r, ts[r], cfg["H"], cfg["E"], cfg["K"], seed=100 + i, mask_frac=0.1)
              for i, ts in enumerate(T_SCRIPT[W])] for r in range(W)]
    res = run_cpu_world(W, _script_world, cfg, calls, geometry, timeout_s=240)
    check_calls(cfg, calls, res)


def _reads_world(group, mode):
    os.environ["TRITONEP_SYNC_CHECKS"] = mode
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, 64, 8, 2, backend="triton")
    x, idx, w = make_rank_inputs(rank, 8, 64, 8, 2, seed=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    impl = backend_of(buf)
    reads = []
    for _ in range(2):
        n0 = impl.host_reads
        d = buf.dispatch(x, idx, w)
        n1 = impl.host_reads
        y = buf.combine((d.x.float() * 0.5).to(BF16), d.handle)
        n2 = impl.host_reads
        y.float().sum().backward()
        reads.append((n1 - n0, n2 - n1, impl.host_reads - n2))
    buf.close()
    return reads


@pytest.mark.parametrize("mode,want", [("deferred", (1, 1, 0)), ("1", (2, 1, 2)), ("0", (0, 0, 0))])
def test_host_reads_per_call(mode, want):
    """Deferred (default): one host read per dispatch and one per combine (its status, published by its last launch:
    a peer's refusal or timeout raises in the call), none in either backward; strict adds one status read at the
    end of every other call (the combine's own read is that one); 0 reads nothing."""
    for reads in run_cpu_world(2, _reads_world, mode, timeout_s=120):
        assert reads == [want, want], reads
