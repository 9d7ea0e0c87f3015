"""Per-call collectives, host reads and copies of the nccl backend, counted on the CPU: a regression fails.

The backend's calls run on its GPU path (``use_triton``; the kernels run in the interpreter, outside the counters:
:func:`tritonep.bench.host_path.stub_launches` with ``run``). A ``TorchDispatchMode`` sees every ``c10d`` op (what
the GPU profiler shows as ``c10d::_allgather_base_`` / ``c10d::alltoall_base_``) and every copy op (``copy_``,
``clone``, ``_to_copy``); ``host_reads`` counts the device->host reads.

Pinned here (world 2, bf16; a rank with tokens and one without):

* dispatch: exactly one all_gather (the counts matrix) then one all_to_all (the packets, counts of the layout in the
  host plan), one host read, two copies: the read of the gathered matrix and the host->device copy of the plan
  vector. The handle's own copy of the routing is written by the pack launch, not by two clones.
* combine: one all_to_all, then one all_gather of every rank's refused flag (tritonep/backends/nccl/combine.py), no copy;
  one host read (the flags) when eager, none sync-free.
* a rank with an expert id outside ``[-1, E)``: every rank runs the same one all_gather and nothing else (no rows
  move), then raises its typed error; the next dispatch is counted as above.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tritonep.testing import run_cpu_world
from tests.support.hooks import backend_of

_COPIES = ("copy_", "clone", "_to_copy")


class _Ops(TorchDispatchMode):
    """Records the ``c10d`` collectives and counts the copy ops dispatched inside the ``with``."""

    def __init__(self):
        super().__init__()
        self.collectives, self.copies = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":
            self.collectives.append(name)
        elif name in _COPIES:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def _calls(group, T0, T1, bad_rank):
    from tritonep import EPBuffer
    from tritonep.bench.host_path import stub_launches
    from tritonep.errors import InputError, PeerInputError
    from tritonep.bench.cases import make_rank_inputs

    rank = dist.get_rank(group)
    T = (T0, T1)[rank]
    x, idx, w = make_rank_inputs(rank, T, 64, 8, 2, seed=4, mask_frac=0.2)
    w = w.float()
    buf = EPBuffer(group, 8, 64, 16, 2, backend="nccl", device="cpu")
    impl = backend_of(buf)
    impl.use_triton = True  # the GPU path; its kernels run in the interpreter, uncounted
    out = {}
    with stub_launches(buf, run=True):
        def measure(name, fn):
            r0 = impl.host_reads
            res, err = None, None
            with _Ops() as ops:
                try:
                    res = fn()
                except (InputError, PeerInputError) as e:
                    err = type(e).__name__
            out[name] = dict(collectives=ops.collectives, copies=ops.copies, reads=impl.host_reads - r0, err=err)
            return res

        impl.dispatch_fwd(x, idx, w, True)  # warm (each variant's first launch)
        if bad_rank is not None:
            bad = idx.clone()
            if rank == bad_rank and T:
                bad[0, 0] = 99
            measure("bad_dispatch", lambda: impl.dispatch_fwd(x, bad, w, True))
        o, ow, _, _, h = measure("dispatch", lambda: impl.dispatch_fwd(x, idx, w, True))
        idx_before, w_before = idx.clone(), w.clone()
        idx.fill_(-1)  # the caller refills its routing in place: the handle's copy is its own
        w.fill_(7.0)
        out["handle_copy"] = torch.equal(h.topk_idx, idx_before) and torch.equal(h.topk_weights, w_before)
        eo = (o.float() * 0.5).to(torch.bfloat16)
        measure("combine", lambda: impl.combine_fwd(eo, h, read=True))  # eager, as EPBuffer.combine passes
    buf.close()
    return out


@pytest.mark.parametrize("tokens", [(12, 9), (12, 0)])
def test_nccl_dispatch_one_gather_one_a2a_one_read(tokens):
    res = run_cpu_world(2, _calls, *tokens, None, timeout_s=300)
    for rank, out in enumerate(res):
        d, c = out["dispatch"], out["combine"]
        assert d["collectives"] == ["_allgather_base_", "alltoall_base_"], (rank, d)
        assert d["reads"] == 1 and d["copies"] == 2 and d["err"] is None, (rank, d)
        assert c["collectives"] == ["alltoall_base_", "_allgather_base_"], (rank, c)
        assert c["reads"] == 1 and c["copies"] == 0, (rank, c)
        assert out["handle_copy"], rank


def test_nccl_bad_ids_gather_once_and_move_nothing():
    res = run_cpu_world(2, _calls, 12, 9, 1, timeout_s=300)
    for rank, out in enumerate(res):
        b = out["bad_dispatch"]
        assert b["collectives"] == ["_allgather_base_"], (rank, b)  # no all_to_all: nothing moved on any rank
        assert b["err"] == ("InputError" if rank == 1 else "PeerInputError"), (rank, b)
        assert b["reads"] == (2 if rank == 1 else 1), (rank, b)  # + the read naming the bad value on its rank
        d = out["dispatch"]
        assert d["collectives"] == ["_allgather_base_", "alltoall_base_"] and d["reads"] == 1, (rank, d)
