"""Named regions -> one pure layout function -> ``required_bytes``.

A symmetric buffer is declared as a list of named regions (name, shape, dtype). :func:`layout` places them one
after another at 256-byte aligned offsets; the same function answers :func:`required_bytes`, so sizing a buffer
before any group exists and allocating it later can never disagree (docs/protocols.md (symmetric memory)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..errors import LayoutError

__all__ = ["ALIGN", "Region", "Layout", "layout", "required_bytes"]

ALIGN = 256
"""Alignment of every region's offset, in bytes."""


@dataclass(frozen=True)
class Region:
    """One named region of a symmetric buffer.

    Args:
        name: unique name inside its buffer.
        shape: tensor shape (every entry >= 0).
        dtype: element type.

    Raises:
        LayoutError: a negative dimension.
    """

    name: str
    shape: tuple
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise LayoutError(f"region {self.name!r} has a negative dimension: shape={self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Layout:
    """Where every region of a buffer lives: ``offsets[name]`` in bytes from the buffer base, ``total`` bytes."""

    regions: tuple
    offsets: dict
    total: int

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise LayoutError(f"no region named {name!r}; regions: {[r.name for r in self.regions]}")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def layout(regions: Iterable[Region], capacity: int | None = None, align: int = ALIGN) -> Layout:
    """Lay regions out back to back at ``align``-byte aligned offsets.

    Args:
        regions: the regions, in order; names must be unique.
        capacity: if given, the space (bytes) the layout must fit into.
        align: offset alignment in bytes (default 256).

    Returns:
        A :class:`Layout`; ``total`` is rounded up to ``align``.

    Raises:
        LayoutError: duplicate names, or ``total > capacity`` (the message names both numbers).
    """
    regions = tuple(regions)
    offsets: dict = {}
    off = 0
    for r in regions:
        if r.name in offsets:
            raise LayoutError(f"duplicate region name {r.name!r}")
        offsets[r.name] = off
        off = _round_up(off + r.nbytes, align)
    total = _round_up(off, align)
    if capacity is not None and total > capacity:
        raise LayoutError(
            f"layout of {len(regions)} regions needs {total} bytes but only {capacity} bytes are available "
            f"(largest region: {max(regions, key=lambda r: r.nbytes).name if regions else None})"
        )
    return Layout(regions=regions, offsets=offsets, total=total)


def required_bytes(regions: Sequence[Region]) -> int:
    """Bytes one rank needs for ``regions``: exactly what :func:`layout` (and so the heap) allocates."""
    return layout(regions).total
