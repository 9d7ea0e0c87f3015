"""Overlap benchmark: a capped-SM dispatch + combine running beside an expert-sized GEMM on another stream.

The point of ``num_sms`` (so that expert GEMMs of the previous chunk can run beside them) is that the
communication kernels leave the rest of the chip to compute. This measures, on each rank, with CUDA events:
``gemm`` alone, ``comm`` (dispatch + combine, one CUDA graph) alone, and both launched together on two streams
(``both``); ``hidden = (gemm + comm - both) / min(gemm, comm)`` is the fraction of the shorter one that was hidden
(1 = perfect overlap, 0 = serialised). Run under torchrun (one process per GPU). After timing, the captured
dispatch and combine outputs are checked against the oracle (:class:`tritonep.bench.check.PointChecker`; the expert
output is filled once outside the graph, which never writes it): the row's ``checked``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["bench_overlap"]


def bench_overlap(group, profile: str = "deepseek-v3", num_sms_list=(24, 0), gemm_rows: int = 8192,
                  iters: int = 20) -> list[dict]:
    """Rows ``{profile, num_sms, gemm_us, comm_us, both_us, hidden, checked}`` for each SM cap (0 = the table)."""
    import tritonep as tep

    from .check import PointChecker, compare_exact, mark_checked
    from .ep import PROFILES, _routing, time_rounds

    p = PROFILES[profile]
    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    H, E, K, T = p["hidden"], p["num_experts"], p["topk"], p["tokens"] or 4096
    idx, w, _ = _routing(rank, T, E, K, 0, dev)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    chk = PointChecker(group, x, idx, w, E)
    ga = torch.randn(gemm_rows, H, device=dev, dtype=torch.bfloat16)
    gb = torch.randn(H, 4096, device=dev, dtype=torch.bfloat16)
    gc = torch.empty(gemm_rows, 4096, device=dev, dtype=torch.bfloat16)
    s_comm, s_gemm = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    for sms in num_sms_list:
        buf = tep.EPBuffer(group, E, H, T, K, num_sms=sms or None)
        with torch.cuda.stream(s_comm):  # warm-up (compiles) outside capture
            d = buf.dispatch(x, idx, w)
            buf.combine(buf.expert_out_buffer(d.x.shape[0]), d.handle)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s_comm):
            d = buf.dispatch(x, idx, w)
            eo = buf.expert_out_buffer()
            y = buf.combine(eo, d.handle)
        g.replay()
        torch.cuda.synchronize()
        chk.expert_out(eo, d)
        main = torch.cuda.current_stream()

        def comm():
            g.replay()

        def gemm():
            torch.mm(ga, gb, out=gc)

        def both():
            s_comm.wait_stream(main)
            s_gemm.wait_stream(main)
            with torch.cuda.stream(s_comm):
                g.replay()
            with torch.cuda.stream(s_gemm):
                torch.mm(ga, gb, out=gc)
            main.wait_stream(s_comm)
            main.wait_stream(s_gemm)

        t_gemm = time_rounds(gemm, group, iters)
        t_comm = time_rounds(comm, group, iters)
        t_both = time_rounds(both, group, iters)
        r = dict(profile=profile, num_sms=sms, gemm_rows=gemm_rows, gemm_us=t_gemm, comm_us=t_comm,
                 both_us=t_both, hidden=(t_gemm + t_comm - t_both) / max(1e-9, min(t_gemm, t_comm)))
        torch.cuda.synchronize()
        err = compare_exact(dict(y=y), dict(y=chk.oracle("bf16")[1]))
        chk.dispatch(r, d, "bf16")
        rows.append(mark_checked(r, "; ".join(e for e in (r.get("check_error", ""), err) if e), rank))
        buf.close()
        torch.cuda.empty_cache()
    return rows
