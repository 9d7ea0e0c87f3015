"""The kernel tiles a buffer of a configuration gets, as its constructor reads them (the environment included)."""

from __future__ import annotations

__all__ = ["tiles_of"]


def tiles_of(device_type: str, world_size: int, hidden: int, max_tokens_per_rank: int, topk: int, wire: str = "bf16",
             num_sms: int | None = None, **options):
    """The :class:`tritonep.backends.triton.tiles.KernelTiles` of an EPBuffer of this configuration (``E = 8 W``,
    dispatch wire ``wire``): :func:`tritonep.ep.config.build_config`'s, so TRITONEP_GEOMETRY / TRITONEP_COMBINE /
    TRITONEP_NUM_SMS / TRITONEP_MAX_PROGRAMS count as for a real buffer; ``options``: the constructor's (``tiles``,
    ``max_programs``). No group, no kernel-mode check."""
    from tritonep.ep.config import build_config

    return build_config(world_size=world_size, num_experts=8 * world_size, hidden=hidden,
                        max_tokens_per_rank=max_tokens_per_rank, topk=topk, dispatch_wire=wire, device_type=device_type,
                        num_sms=num_sms, check_kernels=False, **options).tiles
