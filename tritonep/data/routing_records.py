"""What a routing file loads into (:class:`RoutingTrace`, :class:`RoutingHistogram`) and the file read both parsers
share (:mod:`tritonep.data.routing_file` for CSV traces, :mod:`tritonep.data.routing_json` for JSON histograms; the
formats are described in :mod:`tritonep.data.routing_file`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..errors import DataError

__all__ = ["RoutingTrace", "RoutingHistogram", "stat_key", "read_text"]


@dataclass
class RoutingTrace:
    """Per-token routing read from a CSV (see the module docstring for the format).

    Attributes:
        path: the file as given.
        topk: K, the number of ``e<k>`` columns.
        has_scores: whether the file has ``s<k>`` columns.
        max_expert: the largest expert id in the file (-1 when every slot is -1).
    """

    path: str
    topk: int
    has_scores: bool
    max_expert: int
    _layers: dict = field(repr=False, default_factory=dict)  # layer -> (idx [T, K] int64, scores [T, K] float32)
    _first_use: dict = field(repr=False, default_factory=dict)  # expert id -> (line, col) of its first occurrence

    def layers(self) -> list[int]:
        """The layer numbers in the file, ascending."""
        return sorted(self._layers)

    def num_tokens(self, layer: int) -> int:
        """Tokens of ``layer`` (raises DataError for a layer not in the file)."""
        return self._get(layer)[0].shape[0]

    def _get(self, layer):
        if layer not in self._layers:
            raise DataError(f"{self.path}: no layer {layer!r}; the file has layers {self.layers()}")
        return self._layers[layer]

    def routing(self, layer: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's routing in arrival (``token``) order.

        Args:
            layer: one of :meth:`layers`.
            renormalize: True (default) divides each row's weights by their sum over the valid slots, so they sum
                to 1 (rows whose sum is 0 stay 0); False returns the file's scores (1.0 per valid slot without score
                columns). Slots with id -1 always weigh 0.

        Returns:
            ``(topk_idx [T, K] int64 in [-1, E), topk_weights [T, K] float32)``, fresh tensors.

        Raises:
            DataError: ``layer`` is not in the file.
        """
        idx, w = self._get(layer)
        idx, w = idx.clone(), w.clone()
        if renormalize:
            s = w.sum(dim=1, keepdim=True)
            w = torch.where(s > 0, w / torch.where(s > 0, s, torch.ones_like(s)), w)
        return idx, w

    def check_num_experts(self, num_experts: int, what: str = "num_experts") -> None:
        """Raise DataError ``FILE:LINE:COL`` at the first id ``>= num_experts`` (``what`` names the setting)."""
        bad = [(pos, e) for e, pos in self._first_use.items() if e >= num_experts]
        if bad:
            (line, col), e = min(bad)
            raise DataError(f"{self.path}:{line}:{col}: expert id {e} does not fit {what}={num_experts}: the file "
                            f"uses expert ids up to {self.max_expert}, so it needs {what} >= {self.max_expert + 1}")


@dataclass
class RoutingHistogram:
    """Expert-load histograms read from a JSON file (see the module docstring for the format).

    Attributes:
        path: the file as given.
        num_experts: E, the length of every histogram.
        topk: the file's ``topk`` (None if absent).
        max_expert: the largest expert id with a positive count in any layer.
    """

    path: str
    num_experts: int
    topk: int | None
    max_expert: int
    _counts: dict = field(repr=False, default_factory=dict)  # layer -> [E] int64
    _first_use: dict = field(repr=False, default_factory=dict)  # expert id -> (line, col) of its first positive count

    def layers(self) -> list[int]:
        """The layer numbers in the file, ascending."""
        return sorted(self._counts)

    def counts(self, layer: int, num_experts: int | None = None) -> torch.Tensor:
        """One layer's histogram ``[num_experts]`` int64 (default: the file's E; more experts are padded with 0).

        Raises:
            DataError: ``layer`` is not in the file, or ``num_experts`` cuts off experts with a positive count.
        """
        if layer not in self._counts:
            raise DataError(f"{self.path}: no layer {layer!r}; the file has layers {self.layers()}")
        c = self._counts[layer].clone()
        if num_experts is None:
            return c
        self.check_num_experts(num_experts)
        out = torch.zeros(num_experts, dtype=torch.int64)
        n = min(num_experts, c.numel())
        out[:n] = c[:n]
        return out

    def check_num_experts(self, num_experts: int, what: str = "num_experts") -> None:
        """Raise DataError ``FILE:LINE:COL`` at the first positive count of an expert ``>= num_experts``."""
        bad = [(pos, e) for e, pos in self._first_use.items() if e >= num_experts]
        if bad:
            (line, col), e = min(bad)
            raise DataError(f"{self.path}:{line}:{col}: expert {e} has routes but {what}={num_experts}: the file "
                            f"counts routes up to expert {self.max_expert}, so it needs {what} >= "
                            f"{self.max_expert + 1}")


def stat_key(path: str):
    """``(absolute path, mtime ns, size)`` of a routing file: the parsers' cache key. Raises DataError if it cannot
    be read or is not a file."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read the routing file ({e.strerror or e})") from None
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a file")
    return os.path.abspath(path), st.st_mtime_ns, st.st_size


def read_text(path: str) -> str:
    """The file as UTF-8 text (a BOM dropped). Raises DataError ``FILE:LINE:COL`` when it cannot be read or is
    not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read the routing file ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}:{line}:{col}: not UTF-8 text") from None
