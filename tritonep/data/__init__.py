"""Real MoE routing data shipped with tritonep (Apache-2.0; provenance in README.md, license in LICENSE-DATA.md)."""

from .loaders import (
    FLAME_FILE,
    OLMOE_FILE,
    flame_layers,
    load_flame_trace,
    load_olmoe_histogram,
    olmoe_domains,
    olmoe_layers,
    sample_routing,
    scale_histogram_to_experts,
    split_across_ranks,
)

__all__ = [
    "FLAME_FILE",
    "OLMOE_FILE",
    "flame_layers",
    "load_flame_trace",
    "split_across_ranks",
    "olmoe_domains",
    "olmoe_layers",
    "load_olmoe_histogram",
    "sample_routing",
    "scale_histogram_to_experts",
]
