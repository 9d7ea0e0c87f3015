"""GPU rank functions for the host protocol rule (docs/protocols.md, "Host protocol rule": every rank issues the
same collectives and launches whatever its data): per-rank token-count scripts, eager and in CUDA graphs, and a bad
input on one rank. Module-level so spawned ranks can import them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.bench.cases import make_rank_inputs

from .gpu_checks import capture_round_trip

__all__ = ["t_script_world", "bad_input_world"]


def t_script_world(group, cfg: dict, script: list, graphs: bool, geometry: str = "", wire: str = "bf16"):
    """Run dispatch + combine once per entry of ``script`` (``script[i][r]`` = tokens of rank r in call i, 0 allowed).

    Eager (``graphs=False``): each call's result is read back. Graphs: one CUDA graph per token count this rank
    meets in the script is captured (every capture holds the same launch sequence whatever T: the rule under test;
    ranks capture different numbers of graphs, which launches nothing), then each call replays the graph of this
    rank's T; rows beyond ``expert_offsets[-1]`` are ignored. Inputs come from
    :func:`tritonep.bench.cases.make_rank_inputs` with seed ``1000 + i``, so the host can rebuild them.
    ``geometry``: a TRITONEP_GEOMETRY string for this world; ``wire``: dispatch and combine wire.

    Returns:
        list per call of records (:mod:`tests.support.harness`; CPU tensors; graphs: ``x``, ``w`` and ``eo``
        trimmed to ``expert_offsets[-1]``).
    """
    import os

    import tritonep as tep
    from tritonep.memory import group_barrier

    from .harness import expert, record, run_call

    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, Tm, K = cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"]
    buf = tep.EPBuffer(group, E, H, Tm, K, dispatch_wire=wire, combine_wire=wire)
    out = []
    if not graphs:
        out = [run_call(buf, *make_rank_inputs(rank, ts[rank], H, E, K, seed=1000 + i)) for i, ts in enumerate(script)]
        buf.close()
        return out
    static = {}
    for T in sorted({ts[rank] for ts in script}):
        sx = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
        si = torch.full((T, K), -1, dtype=torch.int64, device=dev)
        sw = torch.zeros(T, K, dtype=torch.float32, device=dev)
        g, d, eo, y = capture_round_trip(buf, sx, si, sw, expert)
        static[T] = (g, sx, si, sw, d, eo, y)
    group_barrier(group, dev)  # NCCL, or gloo when ranks share a GPU
    for i, ts in enumerate(script):
        g, sx, si, sw, d, eo, y = static[ts[rank]]
        x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, ts[rank], H, E, K, seed=1000 + i))
        sx.copy_(x)
        si.copy_(idx)
        sw.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        R = int(d.expert_offsets[-1])
        out.append(record(d, eo[:R], y))
        out[-1].update(x=out[-1]["x"][:R], w=out[-1]["w"][:R])
    buf.check()
    buf.close()
    return out


def _identity(x):
    return x


def bad_input_world(group, E=64, H=2048, Tm=8, K=8):
    """Step 1: rank 1's ``topk_idx`` holds ``E + 35``; every rank must raise (InputError / PeerInputError) and
    step 2 must pair correctly. Returns per step ``("ok", record)`` (identity expert) or ``(error class name,
    message)``."""
    import tritonep as tep

    from .harness import run_call

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = tep.EPBuffer(group, E, H, Tm, K)
    res = []
    for step in range(3):
        x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, 1 + step, H, E, K, seed=50 + step))
        if step == 1 and rank == 1:
            idx[0, 0] = E + 35
        try:
            res.append(("ok", run_call(buf, x, idx, w, fn=_identity, out_buffer=False)))
        except tep.errors.TritonEPError as e:
            res.append((type(e).__name__, str(e)))
    buf.close()
    return res
