"""A field of a call's storage block that is a device address first and a tensor only when someone reads it.

A dispatch of the triton backend allocates ONE int32 block for its handle and hands ~9 fields of it to its kernels
(:class:`tritonep.backends.triton.outputs.HandleLayout`). Cutting the block into tensor views costs ~17 us of host time
per call on the GPU machine (one ``split_with_sizes`` into 18 pieces plus two reinterpreting ``view``) while the
direct launch path (:class:`tritonep.runtime.bound.BoundKernel`) needs only each field's address and dtype. A
:class:`FieldView` is that address and dtype (``data_ptr()`` and ``dtype``, what the direct path reads of a tensor
argument) and builds its tensor view (a slice of the block, reinterpreted for float fields) on first use only:
Triton's own launch path (CPU interpreter, a variant's first GPU launch; :meth:`tritonep.runtime.bound.BoundKernel._args`
calls :meth:`FieldView.tensor`) and a user reading a handle field.

Idea: lazy views over one arena, as allocators hand out offsets rather than tensors (the pplx / DeepEP
"one buffer, pointer arithmetic" style, kept to the launch path here).
"""

from __future__ import annotations

import torch

__all__ = ["FieldView"]


class FieldView:
    """Field ``[start, start + numel)`` (int32 elements) of ``store``, seen as ``dtype`` (same element size).

    Args:
        store: the 1-D int32 storage block of the call. base: ``store.data_ptr()`` (passed in: read once per call).
        start / numel: the field's first element and length, int32 elements. dtype: torch.int32 or torch.float32.

    Attributes:
        dtype: the field's dtype (what Triton specialises a pointer on).
    """

    __slots__ = ("store", "start", "numel", "dtype", "_ptr", "_t")

    def __init__(self, store: torch.Tensor, base: int, start: int, numel: int, dtype: torch.dtype):
        self.store, self.start, self.numel, self.dtype = store, start, numel, dtype
        self._ptr = base + 4 * start
        self._t = None

    def data_ptr(self) -> int:
        """The field's device address (``tensor().data_ptr()`` for a non-empty field)."""
        return self._ptr

    def tensor(self) -> torch.Tensor:
        """The field as a 1-D contiguous tensor view of ``store`` (built once, then cached)."""
        t = self._t
        if t is None:
            t = self.store[self.start:self.start + self.numel]
            if self.dtype is not torch.int32:
                t = t.view(self.dtype)
            self._t = t
        return t

    def __repr__(self) -> str:
        return f"FieldView({self.dtype}, start={self.start}, numel={self.numel})"
