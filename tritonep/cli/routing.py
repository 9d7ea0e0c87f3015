"""The routing a CLI command runs on: the packaged data (``flame``, ``olmoe``) or a file of your own router.

``--routing`` takes ``flame`` (the packaged FLAME-MoE-290M per-token trace), ``olmoe`` (tokens drawn from the packaged
OLMoE-1B-7B expert-load histograms) or the path of a routing file: a per-token CSV trace in the packaged trace's
format or a JSON histogram (:mod:`tritonep.data.routing_file`). Everything here runs in the parent before any rank
starts, so a bad file or flag is one :class:`tritonep.errors.DataError` line (exit 2); the rank bodies call
:func:`layer_routing`, which re-reads a file through the per-process cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DataError

__all__ = ["PACKAGED", "ROUTING_HELP", "RoutingSource", "resolve", "layer_routing", "layer_counts", "token_split",
           "check_layers", "check_tokens", "check_topk"]

PACKAGED = ("flame", "olmoe")

ROUTING_HELP = ("flame: the packaged FLAME-MoE-290M per-token trace (64 experts, top-6); olmoe: tokens drawn from "
                "the packaged OLMoE-1B-7B expert-load histograms (64 experts, strong skew); or the PATH of your own "
                "routing: a CSV trace 'layer,token,e0..e{K-1}[,s0..s{K-1}]' or a JSON histogram (format: "
                "docs/cli.md, 'Routing files')")


@dataclass
class RoutingSource:
    """A resolved ``--routing`` value.

    Attributes:
        spec: ``"flame"``, ``"olmoe"`` or the file path as given.
        kind: ``"trace"`` (per-token routes, used in arrival order) or ``"histogram"`` (routes drawn per token).
        layers: the layer numbers available.
        topk: K of a trace (its e-columns); for a histogram the file's ``topk`` (None if absent; olmoe: 8).
        max_expert: the largest expert id with a route (olmoe: -1, its histograms are tiled to any E).
        file_experts: experts in the source (flame/olmoe: 64; a CSV: max id + 1; a JSON: its histogram length).
        name: how tables and messages call it.
    """

    spec: str
    kind: str
    layers: list
    topk: int | None
    max_expert: int
    file_experts: int
    name: str

    @property
    def is_file(self) -> bool:
        """True for a user routing file (not the packaged data)."""
        return self.spec not in PACKAGED

    def num_tokens(self, layers) -> int:
        """Tokens every one of ``layers`` holds (traces only): the smallest per-layer count."""
        if self.spec == "flame":
            from ..data import load_flame_trace

            return min(load_flame_trace(layer)[0].shape[0] for layer in layers)
        from ..data.routing_file import load_routing_file

        f = load_routing_file(self.spec)
        return min(f.num_tokens(layer) for layer in layers)

    def default_num_experts(self, world_size: int) -> int:
        """The smallest multiple of ``world_size`` that holds the source's experts (packaged data: 64 experts, so 64
        for 1, 2, 4, 8, ... ranks, 66 for 3, 65 for 5; a file: its largest expert id + 1). Extra experts get no
        routes (flame) or their share of the tiled histogram (olmoe)."""
        n = max(self.file_experts, 1)
        return -(-n // max(1, world_size)) * max(1, world_size)

    def check_num_experts(self, num_experts: int) -> None:
        """Refuse a ``--num-experts`` below the source's largest expert id + 1 (more experts are fine).

        Raises:
            DataError: naming the file, line and column of the first id that does not fit (files), or the packaged
                trace's largest id.
        """
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise DataError(f"--num-experts {num_experts!r} must be a positive integer")
        if self.is_file:
            from ..data.routing_file import load_routing_file

            load_routing_file(self.spec).check_num_experts(num_experts, what="--num-experts")
        elif self.max_expert >= num_experts:
            raise DataError(f"--num-experts {num_experts}: the {self.name} uses expert ids up to {self.max_expert}, "
                            f"so it needs --num-experts >= {self.max_expert + 1} (more experts are fine: they "
                            f"receive no routes)")


def resolve(spec: str, domain: str = "arxiv") -> RoutingSource:
    """Resolve a ``--routing`` value (``flame``, ``olmoe`` or a file path) and read the file, checking it.

    Raises:
        DataError: a file that cannot be read or breaks the format (``FILE:LINE:COL: message``), or an unknown OLMoE
            ``domain``.
    """
    if spec == "flame":
        from ..data import flame_layers

        return RoutingSource(spec, "trace", flame_layers(), 6, 63, 64, "flame trace")
    if spec == "olmoe":
        from ..data import olmoe_domains, olmoe_layers

        if domain not in olmoe_domains():
            raise DataError(f"--domain {domain!r}: OLMoE domains are {olmoe_domains()}")
        return RoutingSource(spec, "histogram", olmoe_layers(), 8, -1, 64, f"olmoe ({domain}) histograms")
    from ..data.routing_file import load_routing_file
    from ..data.routing_records import RoutingTrace

    f = load_routing_file(spec)
    if isinstance(f, RoutingTrace):
        return RoutingSource(spec, "trace", f.layers(), f.topk, f.max_expert, f.max_expert + 1, f"trace {spec}")
    return RoutingSource(spec, "histogram", f.layers(), f.topk, f.max_expert, f.num_experts, f"histogram {spec}")


def token_split(total: int, world_size: int) -> list[int]:
    """Tokens per rank of a ``total``-token stream split evenly (the first ``total % world_size`` ranks get one more)."""
    return [total // world_size + (1 if r < total % world_size else 0) for r in range(world_size)]


def layer_routing(spec: str, layer: int, total_tokens: int, world_size: int, num_experts: int, topk: int,
                  domain: str = "arxiv") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-rank ``(topk_idx [T_r, K] int64, topk_weights [T_r, K] float32)`` of one layer; the same in every process.

    Traces: the first ``total_tokens`` tokens in arrival order, weights renormalised to sum to 1 per token, split into
    contiguous per-rank blocks. Histograms: ``total_tokens`` tokens drawn with :func:`tritonep.data.sample_routing`
    (seeded by the layer number) from the histogram widened to ``num_experts`` (olmoe: tiled; a file: padded with
    zero-count experts), split the same way.

    Raises:
        DataError: as the loaders (the parent has checked everything before any rank calls this).
    """
    from ..data import (load_flame_trace, load_olmoe_histogram, sample_routing, scale_histogram_to_experts,
                        split_across_ranks)

    if spec == "flame":
        idx, w = load_flame_trace(layer, renormalize=True)
    elif spec == "olmoe":
        hist = scale_histogram_to_experts(load_olmoe_histogram(domain, layer), num_experts)
        idx, w = sample_routing(hist, total_tokens, topk, generator=layer)
    else:
        from ..data.routing_file import load_routing_file
        from ..data.routing_records import RoutingTrace

        f = load_routing_file(spec)
        if isinstance(f, RoutingTrace):
            idx, w = f.routing(layer, renormalize=True)
        else:
            idx, w = sample_routing(f.counts(layer, num_experts), total_tokens, topk, generator=layer)
    return split_across_ranks(idx, w, world_size, num_tokens=total_tokens)


def layer_counts(spec: str, layer: int, total_tokens: int, world_size: int, num_experts: int, topk: int,
                 domain: str = "arxiv") -> torch.Tensor:
    """The ``[world_size, num_experts]`` int32 per-source-rank expert histogram of :func:`layer_routing`."""
    from ..backends.layout import counts_torch

    parts = layer_routing(spec, layer, total_tokens, world_size, num_experts, topk, domain)
    return torch.stack([counts_torch(p[0], num_experts) for p in parts])


def check_topk(src: RoutingSource, topk: int | None, layers, num_experts: int, domain: str = "arxiv") -> int:
    """The top-k to run with: a trace's own K (``--topk`` must then equal it), for a histogram ``--topk``, else the
    file's ``topk``, else 8; checked against the experts that have routes in each of ``layers``.

    Raises:
        DataError: ``--topk`` differs from a trace's K, or exceeds the experts with a positive count in a histogram.
    """
    if src.kind == "trace":
        if topk is not None and topk != src.topk:
            raise DataError(f"--topk {topk}: the {src.name} routes every token to K={src.topk} experts (columns "
                            f"e0..e{src.topk - 1}); leave --topk out or give {src.topk}")
        return src.topk
    k = topk if topk is not None else (src.topk or 8)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise DataError(f"--topk {k!r} must be a positive integer")
    if src.is_file:
        from ..data.routing_file import load_routing_file

        f = load_routing_file(src.spec)
        for layer in layers:
            nz = int((f.counts(layer) > 0).sum())
            if k > nz:
                raise DataError(f"--topk {k}: layer {layer} of {src.spec} has routes to only {nz} experts, and "
                                f"every token needs {k} distinct ones")
    elif k > num_experts:
        raise DataError(f"--topk {k} exceeds --num-experts {num_experts}")
    return k


def check_layers(src: RoutingSource, layers, flag: str = "--layers") -> list[int]:
    """``layers`` (default: all of the source's), each checked to exist.

    Raises:
        DataError: naming ``flag`` as the user typed it (``--layers 5 99`` for ``run``, ``--layer 99`` for ``plan``),
            the layers that do not exist and the valid ones.
    """
    layers = list(layers) if layers else list(src.layers)
    bad = [x for x in layers if x not in src.layers]
    if bad:
        given = " ".join(str(x) for x in bad)
        raise DataError(f"{flag} {given}: no layer{'s' if len(bad) > 1 else ''} {given} in the {src.name} (its "
                        f"layers: {' '.join(str(x) for x in src.layers)})")
    return layers


def check_tokens(src: RoutingSource, tokens: int | None, default: int, world_size: int, layers,
                 flag: str = "--tokens") -> int:
    """Total tokens per layer over all ranks: ``tokens`` per rank x ``world_size``; a trace caps the default
    (``default`` per rank) at its length, and an explicit ``tokens`` beyond the trace is an error.

    Raises:
        DataError: ``tokens < 1``, or more tokens than the trace holds (naming how many it has).
    """
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise DataError(f"{flag} {tokens!r} must be a positive integer (tokens per rank)")
    want = (tokens if tokens is not None else default) * world_size
    if src.kind != "trace":
        return want
    have = src.num_tokens(layers)
    if tokens is not None and want > have:
        raise DataError(f"{flag} {tokens}: {world_size} ranks x {tokens} = {want} tokens per layer, but the "
                        f"{src.name} has {have} tokens per layer (at most {have // world_size} per rank with "
                        f"{world_size} ranks)")
    return min(want, have)
