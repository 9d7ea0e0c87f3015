"""The DeepEP-compatible Buffer's round trip vs EPBuffer's: what the adapter costs (eager, and graph where the caller's
API allows one); every point checked; JSON.

    torchrun --nproc-per-node 1 benchmarks/deep_ep_compat.py --json $OUT/deep_ep_compat.json   # GPU, world 1
    python benchmarks/deep_ep_compat.py --cpu                                                # 2-rank CPU world: checks

Shape: the ``deepseek-v3`` profile of :data:`tritonep.bench.profiles.PROFILES` (its hidden size, 256 experts, top-8, uniform random
routing), 128 and 4096 tokens per rank (``--tokens``). Sides, each a round trip of the received rows as the expert
output (median of 3 rounds of ``--iters`` calls, CUDA events; graph: the same replayed from a CUDA graph):

* ``compat``: what Megatron / vLLM / SGLang call, ``get_dispatch_layout`` + ``dispatch(x, topk_idx, topk_weights)`` +
  ``combine(recv_x, handle)``, eager (DeepEP's normal dispatch reads its counts on the host: not capturable); the
  Buffer's default way (``compat_path``: ``"carried"`` when the top-k rides with the rows in the rows lane's one
  launch, ``"meta rows"`` when it travels as meta rows of the rows lane, one exchange per dispatch, at small token
  counts; else ``"meta lane"``);
* ``compat_meta_rows``: the same with ``Buffer(carry_topk=False)``: where the rows lane carries the top-k with its
  rows (``compat_path`` ``"carried"``: the one-launch decode tiles) the meta rows instead, to compare the two ways;
* ``compat_meta_lane``: the same with ``Buffer(meta_rows_max_tokens=0)`` (the top-k in a second EPBuffer, the meta
  lane), eager: the two ways side by side on the same GPU run;
* ``compat_worst``: ``compat`` with ``num_worst_tokens`` (no host read), eager and graph;
* ``tep``: ``tritonep.EPBuffer`` on the same tokens and routing (rows per (token, expert), weighted combine), eager
  and graph: the API a new caller would use;
* ``rows``: an EPBuffer of DeepEP's rows alone (one pseudo-expert per rank, no top-k metadata: the compat Buffer's
  rows lane without meta rows; its routing made once, outside the timed calls), eager and graph: the same token rows
  as ``compat``, so ``compat`` / ``rows`` is the adapter's own cost. Its host path is EPBuffer's own (the same counts as ``tep``'s:
  ``benchmarks/probes/host_path.py --compat``); a torch op per call on its routing would time torch, not the lane.

Checks (every point; exit code 1 when one fails): ``compat`` and ``compat_worst`` combine to ``x * (ranks that
received the token)`` bit for bit (DeepEP's unweighted sum of the received rows), their per-expert counts add up to
the received rows, their ids are local and valid; ``rows`` combines to the same bits; ``tep`` within 2e-2 of
``x * sum_k w``. Ratios: ``compat_over_tep_eager`` (the target: 1.15x at 4096 tokens), ``compat_minus_tep_eager_us``
(its +15 us at 128), ``compat_over_rows_eager``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--cpu" in sys.argv[1:]:  # before tritonep's kernels are imported: the CPU world runs them in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tritonep as tep  # noqa: E402
from tritonep.bench.ep import time_graph, time_rounds  # noqa: E402
from tritonep.bench.profiles import PROFILES  # noqa: E402


def _inputs(rank, T, H, E, K, dev, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=g).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev) if T else \
        torch.empty(0, K, dtype=torch.int64, device=dev)
    w = torch.rand(T, K, generator=g).to(dev)
    return x, idx, w


def _timed(row, name, fn, group, iters, graph: bool):
    fn()
    row[f"{name}_eager_us"] = time_rounds(fn, group, iters)
    if graph and torch.cuda.is_available():
        try:
            row[f"{name}_graph_us"] = time_graph(fn, group, iters)[0]
        except Exception as e:  # noqa: BLE001 - a side that cannot be captured is a result, not a crash
            row[f"{name}_graph_us"] = f"capture failed: {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.synchronize()


def bench_point(group, T, H, E, K, iters):
    import tritonep.compat.deep_ep as deep_ep

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x, idx, w = _inputs(rank, T, H, E, K, dev)
    L = E // W
    row = dict(T=T, H=H, E=E, K=K, world_size=W)
    buf = deep_ep.Buffer(group, 0, 0, max_tokens_per_rank=T)
    worst = W * T

    def compat(num_worst=0):
        n, _, ne, itr, _ = buf.get_dispatch_layout(idx, E)
        rx, ridx, rw, counts, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr,
                                                  num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w,
                                                  num_worst_tokens=num_worst)
        y, _, _ = buf.combine(rx, h)
        return y, rx, ridx, counts, itr, h

    ebuf = tep.EPBuffer(group, E, H, T, K, max_recv_tokens=W * T * min(K, L))

    def tep_round():
        d = ebuf.dispatch(x, idx, w)
        return ebuf.combine(d.x, d.handle)

    lane_buf = deep_ep.Buffer(group, 0, 0, max_tokens_per_rank=T, meta_rows_max_tokens=0)

    rows_buf = deep_ep.Buffer(group, 0, 0, max_tokens_per_rank=T, carry_topk=False)

    def compat_meta_rows():  # the top-k as meta rows of the rows lane even where the lane could carry it
        n, _, ne, itr_, _ = rows_buf.get_dispatch_layout(idx, E)
        rx_, _, _, _, h_, _ = rows_buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr_,
                                                num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w)
        return rows_buf.combine(rx_, h_)[0]

    def compat_meta_lane():
        n, _, ne, itr_, _ = lane_buf.get_dispatch_layout(idx, E)
        rx_, _, _, _, h_, _ = lane_buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr_,
                                                num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w)
        return lane_buf.combine(rx_, h_)[0]

    rows = tep.EPBuffer(group, W, H, T, W, max_recv_tokens=W * T)
    ranks = torch.arange(W, dtype=torch.int32, device=dev)
    ones = torch.ones(T, W, device=dev)

    def rows_round(slots):  # the lane alone: its routing made once, outside the timed calls
        d = rows.dispatch(x, slots, ones)
        return rows.combine(d.x, d.handle)

    # checks
    y, rx, ridx, counts, itr, h = compat()
    expect = (x.float() * itr.sum(1, keepdim=True)).bfloat16()
    yw, rxw, ridxw, cw, _, _ = compat(worst)
    R = rx.shape[0]
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    row["compat_exact"] = bool(torch.equal(y, expect)) and sum(counts) == int((ridx >= 0).sum()) and \
        bool(((ridx >= -1) & (ridx < L)).all())
    row["compat_worst_exact"] = bool(torch.equal(yw, expect)) and cw == [] and \
        bool(torch.equal(rxw[:R], rx)) and bool((ridxw[R:] == -1).all())
    slots = torch.where(itr, ranks, -1)  # the compat Buffer's rows-lane routing (its packing kernel's first part)
    row["rows_exact"] = bool(torch.equal(rows_round(slots), expect))
    row["compat_meta_lane_exact"] = bool(torch.equal(compat_meta_lane(), expect))
    row["compat_meta_rows_exact"] = bool(torch.equal(compat_meta_rows(), expect))
    row["compat_path"] = "carried" if h.carried else "meta rows" if h.meta_rows else "meta lane"
    oracle = x.float() * w.sum(1, keepdim=True)
    row["tep_err_vs_oracle"] = float((tep_round().float() - oracle).abs().max() /
                                     oracle.abs().max().clamp_min(1e-30))
    row["received_rows"] = R
    # timings
    _timed(row, "compat", lambda: compat()[0], group, iters, graph=False)
    _timed(row, "compat_meta_lane", compat_meta_lane, group, iters, graph=False)
    _timed(row, "compat_meta_rows", compat_meta_rows, group, iters, graph=False)
    _timed(row, "compat_worst", lambda: compat(worst)[0], group, iters, graph=True)
    _timed(row, "tep", tep_round, group, iters, graph=True)
    _timed(row, "rows", lambda: rows_round(slots), group, iters, graph=True)
    row["compat_over_tep_eager"] = row["compat_eager_us"] / row["tep_eager_us"]
    row["compat_minus_tep_eager_us"] = row["compat_eager_us"] - row["tep_eager_us"]
    row["compat_over_rows_eager"] = row["compat_eager_us"] / row["rows_eager_us"]
    row["compat_meta_lane_minus_tep_eager_us"] = row["compat_meta_lane_eager_us"] - row["tep_eager_us"]
    row["checked"] = row["compat_exact"] and row["compat_worst_exact"] and row["rows_exact"] and \
        row["compat_meta_lane_exact"] and row["compat_meta_rows_exact"] and row["tep_err_vs_oracle"] <= 2e-2
    row["compat_meta_rows_minus_tep_eager_us"] = row["compat_meta_rows_eager_us"] - row["tep_eager_us"]
    buf.destroy()
    rows_buf.destroy()
    lane_buf.destroy()
    ebuf.close()
    rows.close()
    return row


def _rank_rows(group, tokens, shape, iters):
    return [bench_point(group, T, *shape, iters) for T in tokens]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu", action="store_true", help="2-rank CPU world (interpreter), tiny shape, 1 iteration: "
                                                       "the checks only (times mean nothing)")
    args = ap.parse_args(argv)
    from tritonep.bench.meta import run_meta

    meta = run_meta(tritonep=tep.__version__)  # command, commit, torch, triton, CUDA, NCCL, GPU, date
    if args.cpu:
        from tritonep.testing import run_cpu_world

        p = PROFILES["cpu-smoke"]
        rows = run_cpu_world(2, _rank_rows, [6], (p["hidden"], p["num_experts"], p["topk"]), 1, timeout_s=900)[0]
        meta.update(profile="cpu-smoke", device="cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group("nccl")
        p = PROFILES["deepseek-v3"]
        rows = _rank_rows(dist.group.WORLD, args.tokens, (p["hidden"], p["num_experts"], p["topk"]), args.iters)
        meta.update(profile="deepseek-v3", gpu=torch.cuda.get_device_name())
        if dist.get_rank() != 0:
            rows = []
        dist.destroy_process_group()
    for r in rows:
        r.update(meta)
        print(json.dumps(r), flush=True)
    if args.json and rows:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
