"""Routing files of your own router: a per-token CSV trace or a JSON expert-load histogram.

CSV trace (the format of the packaged FLAME trace, ``prefill_2048tok_layers2-9_top6.csv``)::

    layer,token,e0,e1,s0,s1
    0,0,5,2,0.61,0.22
    0,1,7,5,0.48,0.31

* header: ``layer``, ``token``, ``e0..e{K-1}`` (the K chosen expert ids; K is read from the header) and optionally
  ``s0..s{K-1}`` (their router scores), in any order; no other column.
* ``layer``: int >= 0 (any numbering; a file may hold one or many layers).
* ``token``: int >= 0, distinct within a layer; it is the arrival order: a layer's tokens are used in ascending
  ``token`` order (the rows may come in any order) and split into contiguous per-rank blocks.
* ``e<k>``: expert id, int in ``[0, E)``, or ``-1`` for "no expert" (a dropped route); no id twice in a row.
* ``s<k>``: finite float >= 0, not all 0 in a row with a valid route (its token would weigh nothing: a router's
  chosen experts score above 0, a softmax top-1 at least 1/E, a sigmoid always; all zeros mean scores written with
  too few decimals or a broken export). Without score columns every valid route weighs the same.
* blank lines are skipped; fields may carry surrounding spaces; UTF-8 (a BOM is allowed).

JSON histogram (routes per expert, e.g. counted over a run of your model)::

    {"layers": [0, 7], "counts_per_layer": [[120, 3, 77, 0], [40, 40, 60, 60]], "topk": 2}

``counts_per_layer``: one list of E non-negative ints per layer (all the same length, each with a positive count);
``layers``: the layer numbers (default ``0..n-1``); ``topk``: optional, the K tokens were routed with. Other keys are
ignored (e.g. ``"model"``). A bare list of ints is one layer numbered 0; a bare list of such lists is layers 0..n-1.

Every problem raises :class:`tritonep.errors.DataError` with one line ``"FILE:LINE:COL: message"`` (1-based line and
character column of the offending field, or where a missing one was expected).
"""

from __future__ import annotations

import functools
import math
import re

import torch

from ..errors import DataError
from .routing_json import load_routing_json
from .routing_records import RoutingHistogram, RoutingTrace, read_text, stat_key

__all__ = ["load_routing_file", "load_routing_csv"]


def load_routing_file(path: str, num_experts: int | None = None) -> RoutingTrace | RoutingHistogram:
    """Read a routing CSV trace or JSON histogram (chosen by the ``.csv`` / ``.json`` suffix, else by content).

    Args:
        path: the file.
        num_experts: when given, every expert id (CSV) or positive count (JSON) must lie below it.

    Returns:
        :class:`RoutingTrace` (CSV) or :class:`RoutingHistogram` (JSON). Parsed files are cached per process (keyed
        by path, size and modification time); the returned objects hand out fresh tensors.

    Raises:
        DataError: unreadable file, or any format violation, as ``"FILE:LINE:COL: message"``.
    """
    low = str(path).lower()
    if low.endswith(".json"):
        return load_routing_json(path, num_experts)
    if low.endswith(".csv"):
        return load_routing_csv(path, num_experts)
    text = read_text(path).lstrip()
    return load_routing_json(path, num_experts) if text[:1] in ("{", "[") else load_routing_csv(path, num_experts)


def load_routing_csv(path: str, num_experts: int | None = None) -> RoutingTrace:
    """Read a per-token routing CSV (format: module docstring).

    Args:
        path: the CSV file.
        num_experts: when given, an id ``>= num_experts`` is an error naming its line and column.

    Returns:
        :class:`RoutingTrace`: per layer ``topk_idx [T, K] int64`` and scores ``[T, K] float32`` in token order.

    Raises:
        DataError: ``"FILE:LINE:COL: message"`` for an empty file, a missing / unknown / doubled column, a row with
            the wrong number of fields, a value that is not an int (float for scores) or an int outside the int64
            range, a negative layer or token, a
            token twice in a layer, an id below -1 or twice in a row, a negative or non-finite score, a row whose
            valid routes all score 0, no data rows, or an id ``>= num_experts``.
    """
    trace = _parse_csv(path, *stat_key(path))
    if num_experts is not None:
        trace.check_num_experts(num_experts)
    return trace


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""The range of the int64 tensors a trace loads into: every integer field must lie in it."""
_E_COL = re.compile(r"^e(\d+)$")
_S_COL = re.compile(r"^s(\d+)$")


def _fields(line: str):
    """``[(text stripped, 1-based column of its first character)]`` of one comma-separated line."""
    out, start = [], 0
    for part in line.split(","):
        lead = len(part) - len(part.lstrip())
        out.append((part.strip(), start + lead + 1))
        start += len(part) + 1
    return out


def _int(path, ln, col, name, text):
    if not text:
        raise DataError(f"{path}:{ln}:{col}: empty value in column {name!r}")
    try:
        v = int(text)
    except ValueError:
        raise DataError(f"{path}:{ln}:{col}: column {name!r}: {text!r} is not an integer") from None
    if not INT64_MIN <= v <= INT64_MAX:
        raise DataError(f"{path}:{ln}:{col}: column {name!r}: {text} is outside the 64-bit integer range "
                        f"[-2^63, 2^63 - 1] that routing tensors (int64) hold")
    return v


@functools.lru_cache(maxsize=8)
def _parse_csv(path: str, _abspath: str, _mtime: int, _size: int) -> RoutingTrace:
    text = read_text(path)
    lines = text.split("\n")
    rows = [(i + 1, ln.rstrip("\r")) for i, ln in enumerate(lines)]
    rows = [(i, ln) for i, ln in rows if ln.strip()]
    if not rows:
        raise DataError(f"{path}:1:1: empty file: expected a header 'layer,token,e0,...,e{{K-1}}[,s0,...]' "
                        f"and one row per token")
    hln, header = rows[0]
    cols = _fields(header)
    pos: dict[str, int] = {}
    e_idx, s_idx = {}, {}
    for j, (name, col) in enumerate(cols):
        if not name:
            raise DataError(f"{path}:{hln}:{col}: empty column name in the header")
        if name in pos:
            raise DataError(f"{path}:{hln}:{col}: column {name!r} appears twice in the header")
        pos[name] = j
        if m := _E_COL.match(name):
            e_idx[int(m.group(1))] = j
        elif m := _S_COL.match(name):
            s_idx[int(m.group(1))] = j
        elif name not in ("layer", "token"):
            raise DataError(f"{path}:{hln}:{col}: unknown column {name!r}; a routing CSV has the columns layer, "
                            f"token, e0..e{{K-1}} and optionally s0..s{{K-1}}")
    end_col = len(header) + 1
    for need in ("layer", "token", "e0"):
        if need not in pos:
            raise DataError(f"{path}:{hln}:{end_col}: the header lacks column {need!r} (header: {header.strip()!r})")
    K = max(e_idx) + 1
    for k in range(K):
        if k not in e_idx:
            raise DataError(f"{path}:{hln}:{end_col}: the header lacks column 'e{k}' (it has e-columns up to "
                            f"e{K - 1}, so K={K})")
    if s_idx:
        for k in range(K):
            if k not in s_idx:
                raise DataError(f"{path}:{hln}:{end_col}: the header lacks column 's{k}' (score columns must be "
                                f"s0..s{K - 1}, one per e-column, or none)")
        extra = [k for k in s_idx if k >= K]
        if extra:
            j = s_idx[min(extra)]
            raise DataError(f"{path}:{hln}:{cols[j][1]}: column 's{min(extra)}' has no matching 'e{min(extra)}' "
                            f"(K={K} from e0..e{K - 1})")
    ncol = len(cols)
    jl, jt = pos["layer"], pos["token"]
    je = [e_idx[k] for k in range(K)]
    js = [s_idx[k] for k in range(K)] if s_idx else None
    per_layer: dict[int, dict] = {}  # layer -> {token: (line, ids, scores)}
    first_use: dict[int, tuple[int, int]] = {}
    for ln, line in rows[1:]:
        f = _fields(line)
        if len(f) != ncol:
            col = f[ncol][1] - 1 if len(f) > ncol else len(line) + 1
            raise DataError(f"{path}:{ln}:{col}: row has {len(f)} fields, the header has {ncol}")
        layer = _int(path, ln, f[jl][1], "layer", f[jl][0])
        if layer < 0:
            raise DataError(f"{path}:{ln}:{f[jl][1]}: column 'layer': {layer} is negative")
        tok = _int(path, ln, f[jt][1], "token", f[jt][0])
        if tok < 0:
            raise DataError(f"{path}:{ln}:{f[jt][1]}: column 'token': {tok} is negative")
        ids = []
        for k, j in enumerate(je):
            e = _int(path, ln, f[j][1], f"e{k}", f[j][0])
            if e < -1:
                raise DataError(f"{path}:{ln}:{f[j][1]}: column 'e{k}': expert id {e} is negative (-1 = no expert "
                                f"is the only negative id)")
            if e >= 0 and e in ids:
                raise DataError(f"{path}:{ln}:{f[j][1]}: column 'e{k}': expert {e} appears twice in the row")
            if e >= 0 and e not in first_use:
                first_use[e] = (ln, f[j][1])
            ids.append(e)
        if js is not None:
            sc = []
            for k, j in enumerate(js):
                text = f[j][0]
                if not text:
                    raise DataError(f"{path}:{ln}:{f[j][1]}: empty value in column 's{k}'")
                try:
                    v = float(text)
                except ValueError:
                    raise DataError(f"{path}:{ln}:{f[j][1]}: column 's{k}': {text!r} is not a number") from None
                if not math.isfinite(v) or v < 0:
                    raise DataError(f"{path}:{ln}:{f[j][1]}: column 's{k}': score {text} is not a finite number "
                                    f">= 0")
                sc.append(v if ids[k] >= 0 else 0.0)
            if any(e >= 0 for e in ids) and not any(sc):
                raise DataError(f"{path}:{ln}:{f[js[0]][1]}: the scores of this row's routes are all 0, so its "
                                f"token would weigh nothing in the combine; a router's chosen experts score above 0 "
                                f"(a softmax top-1 is at least 1/E, a sigmoid is positive): were the scores written "
                                f"with too few decimals? Leave the s-columns out for equal weights")
        else:
            sc = [1.0 if e >= 0 else 0.0 for e in ids]
        toks = per_layer.setdefault(layer, {})
        if tok in toks:
            raise DataError(f"{path}:{ln}:{f[jt][1]}: layer {layer} has token {tok} twice (first on line "
                            f"{toks[tok][0]})")
        toks[tok] = (ln, ids, sc)
    if not per_layer:
        raise DataError(f"{path}:{hln + 1}:1: no data rows after the header")
    layers = {}
    for layer, toks in per_layer.items():
        order = sorted(toks)
        layers[layer] = (torch.tensor([toks[t][1] for t in order], dtype=torch.int64).view(len(order), K),
                         torch.tensor([toks[t][2] for t in order], dtype=torch.float32).view(len(order), K))
    return RoutingTrace(path=path, topk=K, has_scores=js is not None, max_expert=max(first_use, default=-1),
                        _layers=layers, _first_use=first_use)

