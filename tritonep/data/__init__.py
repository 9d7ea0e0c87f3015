"""Real MoE routing data shipped with tritonep (Apache-2.0; provenance in README.md, license in LICENSE-DATA.md), and
the reader of routing files of your own router (:mod:`tritonep.data.routing_file`)."""

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
from .routing_file import load_routing_file
from .routing_records import RoutingHistogram, RoutingTrace

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
    "load_routing_file",
    "RoutingTrace",
    "RoutingHistogram",
]
