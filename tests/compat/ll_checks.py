"""Rank functions of the low-latency checks (CPU worlds and GPU worlds run the same code on their device)."""

from __future__ import annotations

import torch

from tests.compat.deepep_reference import assert_close, gather, ll_ref, routing

H, L, TOPK, M = 512, 2, 3, 12
TOKENS = (9, 0, 12, 5, 7, 1, 11, 3)  # per rank, <= M: uneven, rank 1 has none


def _dev():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def expert_out(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert``'s output for its bf16 rows: bf16(x * (expert + 1) / 4 - 1), exact to recompute anywhere."""
    return (rows.float() * ((expert + 1) / 4) - 1).bfloat16()


VARIANTS = (  # (use_fp8, round_scale, use_ue8m0, return_recv_hook, zero_copy)
    (False, False, False, False, False),
    (False, False, False, True, True),
    (True, False, False, True, False),
    (True, True, False, False, True),
    (True, True, True, False, False),
)


def ll_case(group, backend: str, seed: int):
    """DeepEP's low-latency semantics on one Buffer: per-expert prefixes in (source rank, token) order, counts, the
    cumulative stats, src_info, layout_range, fp8 bits (float, power-of-two and UE8M0 scales, column-major), and the
    weighted combine (out=, zero_copy, receive hooks), two results alive at once."""
    import tritonep.compat.deep_ep as deep_ep
    from tritonep.wire.fp8 import dequantize_fp8_torch, quantize_fp8_torch

    rank, W = group.rank(), group.size()
    dev, E = _dev(), L * W
    K = min(TOPK, E)  # distinct experts per token (a world of one has two)
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, W, E), low_latency_mode=True,
                         num_qps_per_rank=L, backend=backend)
    held = []
    for v, (fp8, rs, ue, hook_mode, zero_copy) in enumerate(VARIANTS):
        gen = torch.Generator().manual_seed(1000 * seed + 10 * v + rank)
        T = TOKENS[(rank + v) % len(TOKENS)] if W > 1 else 7
        x = torch.randn(T, H, generator=gen).bfloat16().to(dev)
        idx, w = routing(T, E, K, gen, device=dev)
        stats = torch.full((L,), 5, dtype=torch.int32, device=dev)
        recv, count, h, ev, hook = buf.low_latency_dispatch(
            x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, round_scale=rs, use_ue8m0=ue,
            async_finish=not hook_mode, return_recv_hook=hook_mode)
        if hook_mode:
            assert ev.event is None
            hook()
        else:
            assert hook is None
            ev.current_stream_wait()
        xs, ids = map(list, zip(*gather(group, (x, idx))))
        srcs, rng = ll_ref(xs, ids, rank, E, W, M)
        assert count.dtype == torch.int32 and count.tolist() == [len(s) for s in srcs]
        assert stats.tolist() == [5 + len(s) for s in srcs]
        assert torch.equal(h[1].cpu(), rng) and h[2:] == (M, H, E)
        if fp8:
            q, s = recv
            Sx = H // 512 if ue else H // 128
            assert q.shape == (L, W * M, H) and q.dtype == torch.float8_e4m3fn
            assert s.shape == (L, W * M, Sx) and s.stride() == (Sx * W * M, 1, W * M)  # column-major
            assert s.dtype == (torch.int32 if ue else torch.float32)
            twins = [quantize_fp8_torch(xr.cpu(), pow2_scale=rs) for xr in xs]
        else:
            assert recv.shape == (L, W * M, H) and recv.dtype == torch.bfloat16
        sim = torch.full((L, W * M, H), float("nan"), dtype=torch.bfloat16, device=dev)  # past the prefix: unread
        for j in range(L):
            n = len(srcs[j])
            assert h[0][j, :n].tolist() == [t for _, t in srcs[j]], "src_info"
            if not n:
                continue
            if fp8:
                e_q = torch.stack([twins[s_][0][t] for s_, t in srcs[j]])
                e_s = torch.stack([twins[s_][1][t] for s_, t in srcs[j]])
                assert torch.equal(q[j, :n].cpu().view(torch.uint8), e_q.view(torch.uint8)), "fp8 rows"
                if ue:
                    e_b = ((e_s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                    assert torch.equal(s[j, :n].cpu(), e_b.contiguous().view(torch.int32)), "ue8m0 scales"
                else:
                    assert torch.equal(s[j, :n].cpu(), e_s), "scales"
                    if rs:
                        assert bool(((e_s.view(torch.int32) & 0x7FFFFF) == 0).all())  # powers of two
                rows = dequantize_fp8_torch(e_q, e_s).to(dev)
            else:
                rows = torch.stack([xs[s_][t] for s_, t in srcs[j]])
                assert torch.equal(recv[j, :n].cpu().view(torch.int16), rows.view(torch.int16)), "bf16 rows"
                rows = rows.to(dev)
            sim[j, :n] = expert_out(rows, rank * L + j)
        held.append((h, sim, x, idx, w, fp8, rs, zero_copy, hook_mode))
        if len(held) < 2:
            continue
        for h_, sim_, x_, idx_, w_, fp8_, rs_, zc, hm in held:  # two results alive: combine both, older first
            T_ = x_.shape[0]
            src = sim_
            if zc:
                buf.get_next_low_latency_combine_buffer(h_).copy_(sim_)
                src = torch.empty_like(sim_)
            out = torch.empty(T_, H, dtype=torch.bfloat16, device=dev)
            y, ev2, hk = buf.low_latency_combine(src, idx_, w_, h_, zero_copy=zc, out=out, return_recv_hook=hm)
            if hm:
                hk()
            assert y is out
            xr = dequantize_fp8_torch(*quantize_fp8_torch(x_.cpu(), pow2_scale=rs_)) if fp8_ else x_.cpu()
            ref = torch.zeros(T_, H)
            for t in range(T_):
                for k in range(K):
                    e = int(idx_[t, k])
                    if e >= 0:
                        ref[t] += float(w_[t, k]) * expert_out(xr[t:t + 1], e).float()[0]
            assert_close(y.cpu().float(), ref.bfloat16().float(), rtol=2 ** -7, atol=2 ** -7)
            assert not torch.isnan(y).any()
        held = []
    buf.clean_low_latency_buffer(M, H, E)
    buf.destroy()
    return len(VARIANTS)
