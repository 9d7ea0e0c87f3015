"""Benchmarks sized to the card they run on, as expert parallelism spreads a layer.

A full DeepSeek-V3 MoE layer (256 routed experts of 3 x 7168 x 2048 bf16 weights: 88 MB each) holds 22.5 GB of
weights at world 1, 45 GB with their gradients, 90 GB with the copies a bit-exact graph check keeps: an 80 GB H100
cannot hold what a 141 GB H200 can. In a real EP group each GPU holds ``E / W`` of them, so a benchmark at world 1
keeps the layer's shape (hidden, expert width, top-k, expert groups) and halves the routed experts until this rank's
share fits; the rows record the count used.
"""

from __future__ import annotations

__all__ = ["experts_for_card"]


def experts_for_card(num_experts: int, bytes_per_expert: int, world_size: int, card_bytes: int, *,
                     min_experts: int = 1, share: float = 0.5) -> int:
    """Routed experts of a layer sized to the card: ``num_experts`` halved (while it stays even and at least
    ``min_experts``, e.g. top-k or the expert-group count) until this rank's ``num_experts // world_size`` experts
    of ``bytes_per_expert`` (every copy the benchmark keeps: weights, gradients, reference copies) take at most
    ``share`` of ``card_bytes``; the rest is left to activations, communication buffers and compiled graphs.

    Returns the count (``num_experts`` itself when it fits, and never below ``max(min_experts, world_size)``).
    """
    floor = max(min_experts, world_size, 1)
    E = num_experts
    while E % 2 == 0 and E // 2 >= floor and (E // world_size) * bytes_per_expert > share * card_bytes:
        E //= 2
    return E
