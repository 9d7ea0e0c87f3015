"""JSON expert-load histograms (the format is described in :mod:`tritonep.data.routing_file`).

Called by :func:`tritonep.data.routing_file.load_routing_file` for ``.json`` files and JSON content. Errors are
:class:`tritonep.errors.DataError` as ``"FILE:LINE:COL: message"``, positions found by a JSON decoder whose arrays
remember where every item starts.
"""

from __future__ import annotations

import functools
import json
import json.decoder
import json.scanner
import re

import torch

from ..errors import DataError
from .routing_records import RoutingHistogram, read_text, stat_key

__all__ = ["load_routing_json"]


class _PosList(list):
    """A JSON array that remembers where it and each of its items start in the text (character offsets)."""

    pos: int = 0
    item_pos: list


def _decode_with_positions(text: str):
    """``json.loads`` whose arrays are :class:`_PosList` (pure-Python scanner, so every item start is seen)."""
    dec = json.JSONDecoder()

    def parse_array(s_and_end, scan_once):
        s, end = s_and_end
        starts: list[int] = []

        def scan(string, idx):
            starts.append(idx)
            return scan_once(string, idx)

        values, stop = json.decoder.JSONArray((s, end), scan)
        out = _PosList(values)
        out.pos, out.item_pos = end - 1, starts[: len(values)]
        return out, stop

    dec.parse_array = parse_array
    dec.scan_once = json.scanner.py_make_scanner(dec)
    return dec.decode(text)


MAX_COUNT = 1 << 53
"""The largest count per expert and per histogram: tokens are drawn from a histogram's proportions in float64,
exact up to 2^53 (and far inside int64)."""


def _line_col(text: str, idx: int) -> tuple[int, int]:
    line = text.count("\n", 0, idx) + 1
    return line, idx - (text.rfind("\n", 0, idx) + 1) + 1


def load_routing_json(path: str, num_experts: int | None = None):
    """Read a JSON expert-load histogram file (format: module docstring).

    Args:
        path: the JSON file.
        num_experts: when given, an expert ``>= num_experts`` with a positive count is an error naming its position.

    Returns:
        :class:`RoutingHistogram` (per layer ``[E]`` int64 counts).

    Raises:
        DataError: ``"FILE:LINE:COL: message"`` for invalid JSON, an empty file, a missing ``counts_per_layer``,
            histograms of different lengths, a count that is not an int >= 0 or counts beyond 2^53, a layer with no
            positive count, ``layers`` that do not match, a bad ``topk``, or a positive count of an expert
            ``>= num_experts``.
    """
    h = _parse_json(path, *stat_key(path))
    if num_experts is not None:
        h.check_num_experts(num_experts)
    return h


@functools.lru_cache(maxsize=8)
def _parse_json(path: str, _abspath: str, _mtime: int, _size: int):
    """Parse (cached by path, mtime, size) a JSON histogram into a :class:`RoutingHistogram`."""
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path}:1:1: empty file: expected a JSON histogram {{\"counts_per_layer\": [[...], ...]}}")
    try:
        obj = _decode_with_positions(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None

    def at(idx):
        ln, col = _line_col(text, idx)
        return f"{path}:{ln}:{col}"

    def key_at(key):
        m = re.search(r'"' + re.escape(key) + r'"\s*:\s*', text)
        return at(m.end() if m else 0)

    if isinstance(obj, list) and obj and all(isinstance(v, list) for v in obj):
        hists, layers, topk = obj, None, None  # a list of histograms: layers 0..n-1
    elif isinstance(obj, list):
        hists, layers, topk = _PosList([obj]), None, None  # one histogram: layer 0
        hists.pos, hists.item_pos = obj.pos, [obj.pos]
    elif isinstance(obj, dict):
        if "counts_per_layer" not in obj:
            raise DataError(f"{at(0)}: the object lacks the key 'counts_per_layer' (a list of per-expert count "
                            f"lists, one per layer)")
        hists, layers, topk = obj["counts_per_layer"], obj.get("layers"), obj.get("topk")
        if not isinstance(hists, list) or not hists or not all(isinstance(h, list) for h in hists):
            where = at(hists.pos) if isinstance(hists, _PosList) else key_at("counts_per_layer")
            raise DataError(f"{where}: 'counts_per_layer' must be a non-empty list of lists of counts")
    else:
        raise DataError(f"{at(0)}: expected an object with 'counts_per_layer' or a list of counts")
    E = len(hists[0])
    first_use: dict[int, tuple[int, int]] = {}
    counts = []
    for i, h in enumerate(hists):
        if len(h) == 0:
            raise DataError(f"{at(h.pos)}: histogram {i} is empty")
        if len(h) != E:
            raise DataError(f"{at(h.pos)}: histogram {i} has {len(h)} experts, histogram 0 has {E}")
        for e, v in enumerate(h):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DataError(f"{at(h.item_pos[e])}: histogram {i}, expert {e}: {json.dumps(v)} is not an "
                                f"integer count >= 0")
            if v > MAX_COUNT:
                raise DataError(f"{at(h.item_pos[e])}: histogram {i}, expert {e}: {v} routes is beyond the "
                                f"largest count a histogram may hold (2^53: tokens are drawn in float64)")
            if v > 0 and e not in first_use:
                first_use[e] = _line_col(text, h.item_pos[e])
        if not any(h):
            raise DataError(f"{at(h.pos)}: histogram {i} has no positive count (no expert received a route)")
        if sum(h) > MAX_COUNT:
            raise DataError(f"{at(h.pos)}: histogram {i} counts {sum(h)} routes in all, beyond 2^53 (tokens are "
                            f"drawn from its proportions in float64)")
        counts.append(torch.tensor(list(h), dtype=torch.int64))
    if layers is None:
        layers = list(range(len(hists)))
    else:
        if not isinstance(layers, list) or len(layers) != len(hists):
            raise DataError(f"{key_at('layers')}: 'layers' must list one layer number per histogram "
                            f"({len(hists)})")
        for j, v in enumerate(layers):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v in layers[:j]:
                raise DataError(f"{at(layers.item_pos[j])}: layer {json.dumps(v)} is not a distinct integer >= 0")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= E):
        raise DataError(f"{key_at('topk')}: 'topk' must be an integer in 1..{E}, got {json.dumps(topk)}")
    return RoutingHistogram(path=path, num_experts=E, topk=topk, max_expert=max(first_use),
                            _counts=dict(zip((int(v) for v in layers), counts)), _first_use=first_use)
