"""Expert-parallel dispatch / combine: EPBuffer, Dispatched, DispatchHandle and the functional forms."""

from .buffer import EPBuffer
from .handle import Dispatched, DispatchHandle

__all__ = ["EPBuffer", "Dispatched", "DispatchHandle", "dispatch", "combine"]


def dispatch(buffer: EPBuffer, x, topk_idx, topk_weights) -> Dispatched:
    """Functional form of :meth:`EPBuffer.dispatch` (differentiable w.r.t. ``x`` and ``topk_weights``)."""
    return buffer.dispatch(x, topk_idx, topk_weights)


def combine(buffer: EPBuffer, expert_out, handle: DispatchHandle):
    """Functional form of :meth:`EPBuffer.combine` (differentiable w.r.t. ``expert_out`` and the weights)."""
    return buffer.combine(expert_out, handle)
