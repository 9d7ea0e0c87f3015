"""GPU rank function for the output pool (:mod:`tritonep.runtime.pool`): per-stream sets and graph capture.
Module-level so spawned ranks can import it; the test is ``tests/backends/triton/test_output_pool_gpu.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tests.support.gpu_checks import capture_round_trip
from tests.support.hooks import backend_of

__all__ = ["pool_streams_world"]


def _pooled_ptrs(impl) -> set:
    return set().union(*(p.base_ptrs() for p in impl.output_pools()))


def pool_streams_world(group, E: int, H: int, Tmax: int, K: int, T: int):
    """One decode-geometry buffer (``Tmax <= 256``: the GPU default) on this rank; returns a dict of what the test
    checks:

    * ``default``: (storage block, rows, combine output) addresses of 3 calls on the default stream whose outputs the
      caller dropped; ``default_pooled``: whether every one of them is a block of the pools' sets of that stream
      (the sets are used in turn, least recently handed out first); ``default_grew``: whether the pools made a set
      during those calls (they must not: the construction's dry run made the default stream's sets);
    * ``side`` / ``third``: the storage block address of a call on a second / third stream and the pool's bytes
      after it (a second stream gets a set of its own; a third allocates: the bytes do not grow);
    * ``graph_pooled``: whether a captured dispatch's storage block, rows or combine output is a pool set's tensor
      (must be False: a capture allocates from its private pool);
    * ``graph_kept``: the replayed graph's output unchanged by eager calls made after the replay (they reuse sets);
    * ``graph_equal``: a replay's combine output equals an eager call's on the same inputs, bit for bit;
    * ``eager_equal``: every eager call on any stream gives the first call's combine output.
    """
    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs

    from .harness import expert

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = tep.EPBuffer(group, E, H, Tmax, K)
    impl = backend_of(buf)
    assert impl.tiles.decode, impl.tiles
    x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, T, H, E, K, seed=5))

    def call():
        d = buf.dispatch(x, idx, w)
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_(expert(d.x))
        y = buf.combine(eo, d.handle)
        return d, y

    out, ys = {}, []
    ptrs = []
    bytes0 = impl.output_pool_bytes
    for _ in range(3):
        d, y = call()
        ptrs.append((d.handle.store.data_ptr(), d.x.data_ptr(), y.data_ptr()))
        ys.append(y.clone())
        del d, y
    out["default"] = ptrs
    pooled = _pooled_ptrs(impl)
    out["default_pooled"] = all(a in pooled and b in pooled and c in pooled for a, b, c in ptrs)
    out["default_grew"] = impl.output_pool_bytes != bytes0
    for name in ("side", "third"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            d, y = call()
            out[name] = (d.handle.store.data_ptr(), impl.output_pool_bytes)
            ys.append(y.clone())
            del d, y
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g, dg, eo, yg = capture_round_trip(buf, x, idx, w, expert)
    pooled = _pooled_ptrs(impl)
    out["graph_pooled"] = bool({dg.handle.store.data_ptr(), dg.x.data_ptr(), yg.data_ptr()} & pooled)
    g.replay()
    torch.cuda.synchronize()
    kept = yg.clone()
    for _ in range(2):
        d, y = call()
        ys.append(y.clone())
        del d, y
    torch.cuda.synchronize()
    out["graph_kept"] = torch.equal(yg, kept)
    out["graph_equal"] = torch.equal(kept, ys[0])
    out["eager_equal"] = all(torch.equal(y, ys[0]) for y in ys)
    del g, dg, yg
    buf.close()
    return out
