"""The triton backend's dispatch handle: :class:`TritonHandle` (the receiver side of the symmetric-memory protocol,
one storage block per call)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch

from ..handle import DispatchHandle

__all__ = ["TritonHandle"]


@dataclass(frozen=True, kw_only=True)
class TritonHandle(DispatchHandle):
    """Handle of the triton backend: the receiver side of the symmetric-memory protocol, in ONE allocation.

    ``store`` is the call's int32 storage block (the kernels take the block itself and add each field's static
    offset: :data:`tritonep.runtime.bound.STORE`); ``views`` its fields as :class:`tritonep.runtime.field_view.FieldView` s
    (an address and a dtype each; made on first read, like each field's tensor view; the layout is the backend's
    static :class:`tritonep.backends.triton.outputs.HandleLayout`). Fields, as
    properties: ``meta [W, Tmax, K]`` int32 (row of route (src, t, k) here, -1 if elsewhere), ``wts [W, Tmax, K]``
    float32 (its weight), ``ntok [W]`` int32 (tokens of every source), ``rows``, ``counts``, ``topk_idx`` (int32,
    the handle's sanitized copy), ``topk_weights`` (float32 copy), and ``ntpe`` / ``offs`` (the dispatch's
    ``num_tokens_per_expert`` / ``expert_offsets``).
    """

    backend: ClassVar[str] = "triton"
    store: torch.Tensor
    layout: object

    def _fill(self, store: torch.Tensor, layout, num_tokens: int, buffer_id: int, num_recv_rows, recv_weights,
              x_scales, count_sums=None, carried=None):
        """Set every field of a handle made without ``__init__`` (``object.__new__``: the backend makes it while its
        launch runs and fills it after the host read, before any caller sees it). One update of the instance
        dictionary, as the generated frozen ``__init__`` would fill it field by field through
        ``object.__setattr__`` (~2 us of host time per dispatch less)."""
        self.__dict__.update(store=store, layout=layout, num_tokens=num_tokens, num_recv_rows=num_recv_rows,
                             x_scales=x_scales, recv_weights=recv_weights, buffer_id=buffer_id, count_sums=count_sums,
                             carried=carried)

    @cached_property
    def views(self) -> tuple:
        """The fields of :attr:`store` as :class:`tritonep.runtime.field_view.FieldView` s (made once, on first read)."""
        return self.layout.views(self.store)

    def _get(self, name):
        return self.layout.shaped(self.views, name, self.num_tokens)

    meta = property(lambda self: self._get("meta"))
    wts = property(lambda self: self._get("wts"))
    ntok = property(lambda self: self._get("ntok"))
    rows = property(lambda self: self._get("rows"))
    counts = property(lambda self: self._get("counts"))
    topk_idx = property(lambda self: self._get("idx"))
    topk_weights = property(lambda self: self._get("w"))
    ntpe = property(lambda self: self._get("ntpe"))
    offs = property(lambda self: self._get("offs"))
