"""Exactness of the one-launch decode paths inside a benchmark run: the same call on a two-kernel buffer."""

from __future__ import annotations

import torch

__all__ = ["exact_vs_two_kernel"]


def exact_vs_two_kernel(group, buf, x, topk_idx, topk_weights, wire: str) -> bool:
    """Dispatch + combine ``(x, topk_idx, topk_weights)`` on ``buf`` (any kernel tiles, e.g. ``dec=128``) and on a
    fresh buffer of the same configuration with the two-kernel tiles (``tiles="dec=0,fs=0,fe=0"``); True when the received rows,
    expert offsets, row weights and combine outputs (expert output = 0.5 * row + 1, bf16) are equal bit for bit.

    Collective: every rank of ``group`` must call it with its own inputs. Shapes: ``x [T, H]`` bf16,
    ``topk_idx [T, K]``, ``topk_weights [T, K]`` fp32 on the buffer's device.
    """
    import tritonep as tep

    ref = tep.EPBuffer(group, buf.num_experts, buf.hidden, buf.max_tokens_per_rank, buf.topk,
                       dispatch_wire=wire, combine_wire=wire, tiles="dec=0,fs=0,fe=0")
    got = []
    for b in (buf, ref):
        d = b.dispatch(x, topk_idx, topk_weights)
        R = int(d.expert_offsets[-1]) if d.expert_offsets.numel() else 0
        eo = b.expert_out_buffer(d.x.shape[0])
        eo.copy_((d.x.float() * 0.5 + 1.0).to(torch.bfloat16))
        y = b.combine(eo, d.handle)
        got.append((d.x[:R].clone(), d.expert_offsets.clone(), d.weights[:R].clone(), y.clone()))
    ref.close()
    return all(torch.equal(a, b) for a, b in zip(*got))
