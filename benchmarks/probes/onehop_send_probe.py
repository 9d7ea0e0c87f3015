"""Where the one-hop send launch's device time goes: the launch alone, timed with CUDA events over replays of a CUDA
graph of back-to-back launches, at the ``decode`` profile's shape (tritonep/bench/profiles.py), world 1, under variants of its static tiling: header scan step (HT), prefix scan step (ST), warps, and the column split
(programs per token tile).

Run (one GPU)::

    torchrun --nproc-per-node 1 benchmarks/probes/onehop_send_probe.py --json out.json

The first variant is the library's default (:class:`tritonep.backends.nccl.onehop.OneHopDispatch`). Every variant's packets
(``pkt``) and send rows are checked equal to the first's (same inputs). What it found (one H200): the header step
made no difference; every program column redoes its tile's index work, so small token tiles win (16 / 8 / 4 / 2 / 1
tokens per tile: 74 / 41 / 22 / 17.4 / 14.5 us), which is why the send uses one-token tiles.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50, help="launches per captured graph (5 replays timed)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tritonep.bench.ep import one_gpu_inputs
    from tritonep.bench.profiles import profile_shape

    H, E, K, _ = profile_shape("decode")
    T = a.tokens
    dev, x, idx, w = one_gpu_inputs(T, H, E, K)
    from tritonep.backends.nccl.onehop import OneHopDispatch
    from tritonep.backends.nccl.pack import h_split, pow2
    from tritonep.backends.nccl.kernels.onehop import onehop_send_kernel

    from tritonep.ep.config import build_config

    cfg = build_config(world_size=1, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, max_recv_tokens=T * K,
                       device_type=dev.type)
    oh = OneHopDispatch(cfg, group=dist.group.WORLD, rank=0, device=dev)
    KB, lay = pow2(K), oh.lay
    pkt = torch.empty(T, K, dtype=torch.int32, device=dev)
    ic, wc = torch.empty_like(idx), torch.empty_like(w)
    base = dict(send_ptr=oh.send, K=K, KB=KB, E=E, L=E, W=1, EB=pow2(E), WB=1, TCAP=T, N0=H, ROW0=lay.width // 2,
                N1=0, ROW1=lay.width, COL1=0, META=lay.mo // 4, ROW32=lay.width // 4)
    dyn = ("idx_ptr", "w_ptr", "src0_ptr", "src1_ptr", "pkt_ptr", "idx_copy_ptr", "w_copy_ptr", "T", "refused", "HC")
    variants = []
    for bt, ht, st, nw, target in [(1, 16, 16, 4, 264), (4, 16, 16, 8, 264), (2, 16, 16, 4, 264),
                                   (1, 16, 16, 8, 264), (1, 16, 8, 4, 264), (1, 16, 32, 4, 264),
                                   (1, 16, 16, 4, 132), (1, 16, 16, 4, 528), (8, 128, 32, 8, 264)]:
        bh = min(pow2(H), max(16, 1024 // bt))
        k = oh._launch.bind(onehop_send_kernel, dict(base, BT=bt, BH=bh, HT=ht, ST=st, num_warps=nw), dyn)
        nc = max(1, -(-T // bt))
        hs, hc = h_split(nc, H, bh, target)
        variants.append((dict(BT=bt, HT=ht, ST=st, warps=nw, grid=[nc, hs], HC=hc), k, (nc, hs), hc))
    ref = None
    out = []
    for meta, k, grid, hc in variants:
        oh.send.zero_()
        k(grid, idx, w, x, x, pkt, ic, wc, T, 0, hc)
        torch.cuda.synchronize()
        got = (pkt.clone(), oh.send.clone())
        ok = ref is None or (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
        ref = ref or got
        s = torch.cuda.Stream()  # device time: a CUDA graph of `iters` launches, replayed (no host launch cost)
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            for _ in range(a.iters):
                k(grid, idx, w, x, x, pkt, ic, wc, T, 0, hc)
        torch.cuda.current_stream().wait_stream(s)
        graph.replay()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        meta.update(us=e0.elapsed_time(e1) * 1e3 / (5 * a.iters), checked=bool(ok))
        print(meta, flush=True)
        out.append(meta)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command=f"torchrun --nproc-per-node 1 benchmarks/probes/onehop_send_probe.py --tokens {T}",
                           rows=out), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
