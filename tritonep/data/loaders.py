"""Loaders for the real routing data shipped in ``tritonep/data/`` (see README.md / LICENSE-DATA.md there).

Two sources, both Apache-2.0, from real public MoE models:

* FLAME-MoE-290M (CMU-FLAME): per-token top-6 expert ids + router probabilities over 64 experts,
  2,048 tokens x MoE layers 2..9 -> :func:`load_flame_trace`.
* OLMoE-1B-7B (AllenAI): per-layer expert load histograms over 64 experts (top-8, ~209K tokens per
  domain, layers 0 / 7 / 15) -> :func:`load_olmoe_histogram`, plus :func:`sample_routing` to draw
  per-token routes from such a histogram and :func:`scale_histogram_to_experts` to widen it to any E.

Files are read with :mod:`importlib.resources`, so they work from an installed wheel. Parsed tables
are cached per process; every function returns fresh tensors (callers may modify them).
"""

from __future__ import annotations

import functools
import io
import json
from importlib import resources
from typing import Sequence

import numpy as np
import torch

from ..errors import DataError

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

FLAME_FILE = "prefill_2048tok_layers2-9_top6.csv"
OLMOE_FILE = "olmoe_expert_counts.json"
_FLAME_TOKENS = 2048
_FLAME_TOPK = 6


def _read_text(name: str) -> str:
    try:
        return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    except FileNotFoundError as exc:  # pragma: no cover - only when the package data was not installed
        raise DataError(
            f"packaged data file {name!r} is missing from {__package__} (package-data not installed?)"
        ) from exc


@functools.lru_cache(maxsize=None)
def _flame_table() -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """layer -> (ids [2048, 6] int64, probs [2048, 6] float32), parsed once per process."""
    text = _read_text(FLAME_FILE)
    table = np.loadtxt(io.StringIO(text), delimiter=",", skiprows=1, dtype=np.float64, ndmin=2)
    if table.shape[1] != 2 + 2 * _FLAME_TOPK:
        raise DataError(f"{FLAME_FILE}: expected {2 + 2 * _FLAME_TOPK} columns, found {table.shape[1]}")
    layers = table[:, 0].astype(np.int64)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for layer in np.unique(layers).tolist():
        rows = table[layers == layer]
        if rows.shape[0] != _FLAME_TOKENS or not np.array_equal(rows[:, 1], np.arange(_FLAME_TOKENS)):
            raise DataError(f"{FLAME_FILE}: layer {layer} does not hold tokens 0..{_FLAME_TOKENS - 1} in order")
        ids = np.ascontiguousarray(rows[:, 2 : 2 + _FLAME_TOPK]).astype(np.int64)
        probs = np.ascontiguousarray(rows[:, 2 + _FLAME_TOPK :]).astype(np.float32)
        out[int(layer)] = (ids, probs)
    return out


def flame_layers() -> list[int]:
    """MoE layer indices present in the FLAME-MoE-290M trace: ``[2, 3, ..., 9]`` (the model's own numbering)."""
    return sorted(_flame_table())


def load_flame_trace(layer: int, renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Real per-token routing of one FLAME-MoE-290M layer (2,048 consecutive prefill tokens, 64 experts, top-6).

    Args:
        layer: MoE layer, one of :func:`flame_layers` (2..9).
        renormalize: False (default) returns the router softmax probabilities exactly as in the CSV (over all 64
            experts, so a row sums to less than 1); True divides each row by its sum so the 6 weights sum to 1.

    Returns:
        ``(topk_idx [2048, 6] int64, topk_weights [2048, 6] float32)``: expert ids 0..63 (distinct per row, highest
        probability first, never -1) and their probabilities (the CSV's 6-decimal values rounded to float32).

    Raises:
        DataError: ``layer`` is not in the trace (the message lists the valid layers).

    Source: Hugging Face dataset CMU-FLAME/FLAME-MoE-Traces (Apache-2.0); see tritonep/data/README.md.
    """
    table = _flame_table()
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or int(layer) not in table:
        raise DataError(f"FLAME trace has no layer {layer!r}; valid layers: {sorted(table)}")
    ids, probs = table[int(layer)]
    topk_idx = torch.from_numpy(ids.copy())
    topk_weights = torch.from_numpy(probs.copy())
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx, topk_weights


def _split_sizes(total: int, world_size: int, uneven: bool, empty_rank: int | None) -> list[int]:
    ranks = [r for r in range(world_size) if r != empty_rank]
    sizes = [0] * world_size
    if not ranks:
        return sizes
    n = len(ranks)
    if uneven:
        # rank i (i-th non-empty rank) gets share (i+1) / (1+2+...+n); rounding remainder goes to the last one
        denom = n * (n + 1) // 2
        part = [total * (i + 1) // denom for i in range(n)]
        part[-1] += total - sum(part)
    else:
        part = [total // n + (1 if i < total % n else 0) for i in range(n)]
    for r, s in zip(ranks, part):
        sizes[r] = s
    return sizes


def split_across_ranks(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    world_size: int,
    num_tokens: int | Sequence[int] | None = None,
    uneven: bool = False,
    empty_rank: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split one token stream into contiguous per-rank blocks, to emulate EP source ranks.

    Args:
        topk_idx: ``[T, K]`` integer expert ids; topk_weights: ``[T, K]`` float weights (same T, K).
        world_size: number of ranks (>= 1).
        num_tokens: None -> use all T tokens; an int N -> use the first N tokens (N <= T); a sequence of
            ``world_size`` ints -> explicit per-rank counts (sum <= T; ``uneven`` / ``empty_rank`` are then ignored).
        uneven: False -> even split: every rank gets ``N // world`` tokens and the first ``N % world`` ranks one
            more. True -> deterministic uneven split: the i-th rank that receives tokens gets
            ``floor(N * (i + 1) / (n (n + 1) / 2))`` tokens (n = ranks receiving tokens), i.e. a 1:2:...:n ramp,
            and the rounding remainder goes to the last rank.
        empty_rank: if given, that rank gets 0 tokens and the tokens are split over the other ranks (with the rule
            above); with ``world_size == 1`` no rank gets tokens.

    Returns:
        ``world_size`` pairs ``(topk_idx [T_r, K], topk_weights [T_r, K])`` (copies, same dtypes); rank r holds the
        tokens after those of ranks < r.

    Raises:
        DataError: ``world_size < 1``, ``empty_rank`` outside ``[0, world_size)``, mismatched shapes, or token
            counts that are negative or exceed T (the message names the value).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DataError(f"world_size must be an int >= 1, got {world_size!r}")
    if topk_idx.dim() != 2 or topk_weights.shape != topk_idx.shape:
        raise DataError(
            f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} must be the same [T, K]"
        )
    if empty_rank is not None and not (0 <= empty_rank < world_size):
        raise DataError(f"empty_rank={empty_rank!r} outside valid ranks 0..{world_size - 1}")
    total = topk_idx.shape[0]
    if num_tokens is None or isinstance(num_tokens, int):
        n = total if num_tokens is None else num_tokens
        if not (0 <= n <= total):
            raise DataError(f"num_tokens={n} outside 0..{total} (tokens available)")
        sizes = _split_sizes(n, world_size, uneven, empty_rank)
    else:
        sizes = [int(s) for s in num_tokens]
        if len(sizes) != world_size or min(sizes, default=0) < 0 or sum(sizes) > total:
            raise DataError(
                f"num_tokens={list(num_tokens)} must be {world_size} non-negative counts summing to <= {total}"
            )
    out = []
    start = 0
    for s in sizes:
        out.append((topk_idx[start : start + s].clone(), topk_weights[start : start + s].clone()))
        start += s
    return out


@functools.lru_cache(maxsize=None)
def _olmoe_table() -> dict:
    return json.loads(_read_text(OLMOE_FILE))


def olmoe_domains() -> list[str]:
    """Text domains of the OLMoE histograms: ``['arxiv', 'book', 'c4', 'github', 'wikipedia', 'tulu']``."""
    return list(_olmoe_table()["domains"])


def olmoe_layers() -> list[int]:
    """Layers counted in the OLMoE histograms: ``[0, 7, 15]``."""
    return list(_olmoe_table()["layers"])


def load_olmoe_histogram(domain: str = "arxiv", layer: int = 0) -> torch.Tensor:
    """Real expert-load histogram of OLMoE-1B-7B (64 experts, top-8) on one text domain and layer.

    Args:
        domain: one of :func:`olmoe_domains`.
        layer: one of :func:`olmoe_layers` (0, 7, 15).

    Returns:
        ``counts [64] int64``: ``counts[e]`` = tokens (of ~209K) that had expert e in their top-8; sums to
        ``tokens * 8``. Strongly skewed (arxiv layer 0: expert 0 takes ~12% of all assignments).

    Raises:
        DataError: unknown domain or layer (the message lists the valid ones).

    Source: allenai/OLMoE ``scripts/routing_output`` (Apache-2.0); see tritonep/data/README.md.
    """
    table = _olmoe_table()
    if domain not in table["domains"]:
        raise DataError(f"OLMoE histograms have no domain {domain!r}; valid domains: {list(table['domains'])}")
    layers = list(table["layers"])
    if isinstance(layer, bool) or layer not in layers:
        raise DataError(f"OLMoE histograms have no layer {layer!r}; valid layers: {layers}")
    counts = table["domains"][domain]["counts_per_layer"][layers.index(layer)]
    return torch.tensor(counts, dtype=torch.int64)


def _check_hist(hist: torch.Tensor) -> torch.Tensor:
    if not isinstance(hist, torch.Tensor) or hist.dim() != 1 or hist.numel() == 0:
        raise DataError(f"hist must be a non-empty 1-D tensor of expert counts, got {getattr(hist, 'shape', hist)!r}")
    if hist.is_floating_point() and not torch.isfinite(hist).all():
        raise DataError("hist holds non-finite values")
    if (hist < 0).any():
        raise DataError(f"hist holds negative counts (min {hist.min().item()})")
    return hist


def sample_routing(
    hist: torch.Tensor, num_tokens: int, topk: int, generator: torch.Generator | int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw per-token top-k routes whose expert frequencies follow a load histogram.

    Each token draws ``topk`` DISTINCT experts, sequentially without replacement, each draw with probability
    proportional to ``hist`` among the experts not yet drawn (``torch.multinomial(..., replacement=False)``); ids
    stay in draw order. Weights: ``softmax_k(log p[e_k] + g_k)`` over the token's chosen experts, where
    ``p = hist / hist.sum()`` and ``g_k ~ N(0, 1)`` from the same generator, i.e. a router-like renormalised
    top-k softmax with noise: every weight is > 0 and each row sums to 1 (up to float32 rounding).

    Args:
        hist: ``[E]`` non-negative counts (any real dtype), e.g. :func:`load_olmoe_histogram`.
        num_tokens: T >= 0. topk: K with ``1 <= K <= (number of experts with hist > 0)``.
        generator: a ``torch.Generator`` (CPU) to draw from, an int seed, or None (= seed 0). The same seed always
            gives the same result.

    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] float32)``.

    Raises:
        DataError: bad hist (not 1-D, negative, all zero), T < 0, or K outside ``1..nonzero(hist)``.

    Note: per-slot sampling loses the token-level correlation of real routers; use :func:`load_flame_trace` for real
    per-token top-k sets.
    """
    hist = _check_hist(hist)
    nonzero = int((hist > 0).sum())
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise DataError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not (1 <= topk <= nonzero):
        raise DataError(f"topk={topk!r} must be in 1..{nonzero} (experts with a non-zero count in hist)")
    if isinstance(generator, torch.Generator):
        gen = generator
    else:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if generator is None else int(generator))
    p = hist.detach().to(device="cpu", dtype=torch.float64)
    p = p / p.sum()
    if num_tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64), torch.empty(0, topk, dtype=torch.float32)
    idx = torch.multinomial(p.expand(num_tokens, -1), topk, replacement=False, generator=gen)
    noise = torch.randn(num_tokens, topk, generator=gen, dtype=torch.float64)
    weights = torch.softmax(torch.log(p[idx]) + noise, dim=-1).to(torch.float32)
    return idx.to(torch.int64), weights


def scale_histogram_to_experts(hist: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Widen (or narrow) an ``[n]`` expert histogram to ``num_experts`` experts, deterministically.

    Rule: ``num_experts >= n`` -> tile: ``out[e] = hist[e % n]`` (e.g. 64 -> 256 repeats the 64 loads 4 times, so
    the skew pattern repeats every n experts); ``num_experts < n`` -> fold: ``out[e] = sum of hist[j] for j % E == e``
    (total preserved).

    Args:
        hist: ``[n]`` non-negative counts (int or float). num_experts: E >= 1.

    Returns:
        ``[num_experts]`` tensor, same dtype as ``hist``.

    Raises:
        DataError: bad hist or ``num_experts < 1``.
    """
    hist = _check_hist(hist)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise DataError(f"num_experts must be an int >= 1, got {num_experts!r}")
    n = hist.numel()
    if num_experts >= n:
        return hist[torch.arange(num_experts, device=hist.device) % n].clone()
    out = torch.zeros(num_experts, dtype=hist.dtype, device=hist.device)
    return out.index_add_(0, torch.arange(n, device=hist.device) % num_experts, hist)
