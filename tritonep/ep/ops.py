"""torch.library custom ops of :class:`tritonep.EPBuffer` dispatch / combine, so ``torch.compile`` traces through them.

Four ops, each an opaque call of the buffer's public methods (same kernels, same bits as the plain calls):

* ``tritonep::dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int buffer_id, bool sync_free)
  -> (recv_x [R, H], recv_weights [R] f32, [num_tokens_per_expert | expert_offsets] [2L] i32, ticket)`` (one
  new tensor for the two: an op's outputs may not alias each other) (:meth:`EPBuffer.dispatch`).
  ``sync_free=True``: ``R = max_recv_tokens`` (static), no host read, the real rows are ``[0, expert_offsets[-1])``.
  ``sync_free=False``: ``R`` is data dependent; the fake gives it an unbacked SymInt.
* ``tritonep::combine(Tensor expert_out, Tensor recv_weights, Tensor ticket, int buffer_id, SymInt num_tokens)
  -> y [T, H]`` (:meth:`EPBuffer.combine`). ``recv_weights`` only carries the gradient of the router weights (the
  values used are the ones the dispatch moved); pass the dispatch's ``recv_weights``.
* ``tritonep::dispatch_backward`` / ``tritonep::combine_backward``: the backward halves
  (:meth:`EPBuffer.dispatch_backward`, :meth:`EPBuffer.combine_backward`), wired to the forward ops by
  ``register_autograd``. Higher orders (``create_graph=True``) as :mod:`tritonep.ep.autograd` explains: the
  dispatch backward op's own backward is a new ``tritonep::dispatch`` along the handle's routing, and under
  ``create_graph`` the combine's backward is built from such a dispatch of ``grad_y`` with torch ops (so autograd
  differentiates it w.r.t. ``grad_y``, the row weights and the expert rows).

Opaque objects cross the op boundary as ids, like :mod:`tritonep.moe.ops`:

* a buffer by ``buffer_id`` (:func:`buffer_id` registers it; a weak reference, so a dropped buffer disappears);
* a dispatch's :class:`tritonep.DispatchHandle` by its **ticket**, a 0-dim int64 CPU tensor returned by the dispatch
  op. The handle lives exactly as long as the ticket tensor does (``weakref.finalize``): autograd and
  ``torch.compile`` keep the ticket alive while a combine or a backward still needs it, and nothing leaks when no
  backward ever runs (evaluation, ``no_grad``). A ticket is read on the host (a CPU tensor: no device sync).

Fakes: every output of an op has the metadata its fake gives (storage offset 0, contiguous), checked by
``torch.library.opcheck`` (tests/ep/test_custom_ops_opcheck.py). The row weights of the triton backend are a view
of the handle's storage, whose layout puts them first (:class:`tritonep.backends.triton.outputs.HandleLayout`).

Forward-mode AD: an op returns plain tensors, so a forward-mode dual input (``torch.autograd.forward_ad``) is
refused with InputError (the dispatch and combine ops take part as refused, as for any refused input; the backward
ops raise before any launch); :class:`tritonep.EPBuffer`'s own calls carry tangents exactly. A dispatch op whose
input is refused without a host read (``sync_free=True``) takes part in the combine that follows as refused
(:meth:`EPBuffer.cancel_combine`): the peers, which raise nothing in that call, get NaN from their combine op and
every rank's next :meth:`EPBuffer.check` raises.

Collectives: every op is a collective of the buffer's group (every rank calls the same ops in the same order,
docs/protocols.md (host protocol rule)); activation checkpointing recomputes them in the same order on every rank.

Idea sources: the torch.library custom-ops tutorial (custom_op + register_fake + register_autograd); torchtitan's
MinimalAsyncEP ops (``minimal_async_ep::dispatch`` / ``combine`` with static-capacity fakes); DeepEP's
``num_worst_tokens`` convention for the sync-free row count.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple, Optional

import torch

from ..errors import BufferStateError, CapacityError, ConfigError, InputError
from .autograd import _dispatch_rows, has_tangent
from ..wire.formats import get_wire

__all__ = ["OpDispatched", "buffer_id", "get_buffer", "get_handle", "dispatch", "combine", "dispatch_op",
           "combine_op", "dispatch_backward_op", "combine_backward_op"]

_BUFFERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_BUFFER_IDS: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_HANDLES: dict = {}
_IDS = itertools.count(1)
_TICKETS = itertools.count(1)


def buffer_id(buffer) -> int:
    """The op id of ``buffer`` (an :class:`tritonep.EPBuffer`), registering it on first use (weak reference).

    Call it once outside compiled code and keep the int (a compiled function can close over it as a constant).
    """
    bid = _BUFFER_IDS.get(buffer)
    if bid is None:
        bid = next(_IDS)
        _BUFFERS[bid] = buffer
        _BUFFER_IDS[buffer] = bid
    return bid


def get_buffer(bid: int):
    """The registered buffer of ``bid``. Raises ConfigError when unknown (never registered or garbage collected).

    ``bid`` may be a SymInt: ``torch.compile(dynamic=True)`` makes the int a compiled function closes over symbolic
    too, and the fakes look the buffer up with it; it is read as its value (one guard on it, a recompile for another
    buffer), as a buffer id is a constant of the compiled code (an unhashable SymInt failed the lookup before)."""
    if isinstance(bid, torch.SymInt):
        bid = int(bid)
    buf = _BUFFERS.get(bid)
    if buf is None:
        raise ConfigError(f"no EPBuffer with op buffer_id={bid} (never registered with tritonep.ep.ops.buffer_id, "
                          f"or garbage collected)")
    return buf


def _new_ticket(handle) -> torch.Tensor:
    key = next(_TICKETS)
    ticket = torch.tensor(key, dtype=torch.int64)
    _HANDLES[key] = handle
    weakref.finalize(ticket, _HANDLES.pop, key, None)
    return ticket


def get_handle(ticket: torch.Tensor):
    """The :class:`tritonep.DispatchHandle` a dispatch op's ``ticket`` names.

    Raises BufferStateError when the ticket's handle is gone (its ticket tensor was freed) or it is not a ticket.
    """
    handle = _HANDLES.get(int(ticket))
    if handle is None:
        raise BufferStateError(f"dispatch ticket {int(ticket)} names no live dispatch handle (a ticket is only valid "
                               f"while the tensor the dispatch op returned is alive)")
    return handle


def _refuse_tangents(op: str, *tensors) -> None:
    """InputError when a forward-mode dual tensor reaches a backward op (an op returns plain tensors: its tangent
    would be lost), before any launch: every rank passes dual tensors alike, so every rank raises."""
    if has_tangent(*tensors):
        raise InputError(f"a forward-mode dual tensor (torch.autograd.forward_ad) reaches {op}, which cannot return "
                         f"a tangent; EPBuffer.dispatch / combine / dispatch_backward / combine_backward carry "
                         f"tangents exactly")


# ------------------------------------------------------------------------------------------------ dispatch
@torch.library.custom_op("tritonep::dispatch", mutates_args=())
def dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer_id: int,
                sync_free: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:meth:`EPBuffer.dispatch` of buffer ``buffer_id`` as an op (module docstring): ``(rows, row weights,
    [num_tokens_per_expert | expert_offsets] [2L] int32, ticket)``."""
    buf = get_buffer(buffer_id)
    try:  # forward_ad=False: an op returns plain tensors, so a dual input is refused (taking part as refused)
        d = buf.dispatch(x, topk_idx, topk_weights, sync_free=sync_free, forward_ad=False)
    except (InputError, CapacityError):
        # this rank's own refusal: when the call read nothing (sync-free) only this rank raises and the peers go on
        # to their combine op, so this rank takes part in it as refused now (their output NaN, every check() raises)
        if not buf.last_dispatch_read:
            buf.cancel_combine()
        raise
    # one copy (a single small launch): the two are views of the handle's storage (triton) or of the plan vector
    # (nccl), and an output must not alias another output nor sit at a storage offset its fake does not have
    pair = torch.cat([d.num_tokens_per_expert, d.expert_offsets])
    return d.x, d.weights, pair, _new_ticket(d.handle)


@dispatch_op.register_fake
def _dispatch_fake(x, topk_idx, topk_weights, buffer_id, sync_free):
    buf = get_buffer(buffer_id)
    rows = buf.max_recv_tokens if sync_free else torch.library.get_ctx().new_dynamic_size()
    L = buf.num_local_experts
    return (x.new_empty(rows, buf.hidden, dtype=buf.dtype), x.new_empty(rows, dtype=torch.float32),
            x.new_empty(2 * L, dtype=torch.int32), torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("tritonep::dispatch_backward", mutates_args=())
def dispatch_backward_op(grad_recv_x: torch.Tensor, grad_recv_w: Optional[torch.Tensor], ticket: torch.Tensor,
                         buffer_id: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x [T, H], grad_topk_weights [T, K] f32)`` of a dispatch (:meth:`EPBuffer.dispatch_backward`);
    ``grad_recv_w`` None gives zero weight gradients."""
    buf = get_buffer(buffer_id)
    _refuse_tangents("tritonep::dispatch_backward", grad_recv_x, grad_recv_w)
    gx, gw = buf.dispatch_backward(grad_recv_x, grad_recv_w, get_handle(ticket))
    if gw is None:
        gw = torch.zeros(num_tokens, buf.topk, dtype=torch.float32, device=gx.device)
    return gx, gw


@dispatch_backward_op.register_fake
def _dispatch_backward_fake(grad_recv_x, grad_recv_w, ticket, buffer_id, num_tokens):
    buf = get_buffer(buffer_id)
    return (grad_recv_x.new_empty(num_tokens, buf.hidden, dtype=buf.dtype),
            grad_recv_x.new_empty(num_tokens, buf.topk, dtype=torch.float32))


def _dispatch_setup(ctx, inputs, output):
    x, _idx, topk_weights, bid, _sync_free = inputs
    recv_x, recv_w, _layout, ticket = output
    # the row weights are saved for their version counter (tritonep.ep.autograd.DispatchFn says why): an in-place
    # change of them before the backward is refused there, as torch does for any saved tensor
    ctx.save_for_backward(ticket, recv_w)
    ctx.buffer_id, ctx.num_tokens, ctx.w_dtype = bid, x.shape[0], topk_weights.dtype
    ctx.recv_rows = recv_x.shape[0]


def _dispatch_backward(ctx, grad_recv_x, grad_recv_w, _g_layout, _g_ticket):
    ticket, _recv_w = ctx.saved_tensors
    if grad_recv_x is None:
        buf = get_buffer(ctx.buffer_id)
        grad_recv_x = torch.zeros(ctx.recv_rows, buf.hidden, dtype=buf.dtype, device=buf.device)
    gx, gw = torch.ops.tritonep.dispatch_backward(grad_recv_x, grad_recv_w, ticket, ctx.buffer_id, ctx.num_tokens)
    return gx, None, gw.to(ctx.w_dtype), None, None


dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


def _redispatch(ticket, bid: int, u: torch.Tensor, v: torch.Tensor | None):
    """``(P u, S v)`` (:mod:`tritonep.ep.autograd`): ``u [T, H]`` and ``v [T, K]`` (None: zeros) dispatched by
    ``tritonep::dispatch`` along the routing of the dispatch ``ticket`` names, with its rows (a sync-free one's tail
    zero). Differentiable (the dispatch op's autograd). Collective."""
    handle, buf = get_handle(ticket), get_buffer(bid)
    sync_free = handle.num_recv_rows is None
    if v is None:
        v = torch.zeros(handle.num_tokens, buf.topk, dtype=torch.float32, device=u.device)
    rows, w, layout, _ticket = torch.ops.tritonep.dispatch(u.to(buf.dtype), handle.topk_idx, v.float(), bid,
                                                          sync_free)
    if sync_free:
        real = torch.arange(rows.shape[0], device=rows.device) < layout[-1]
        rows = torch.where(real[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    if get_wire(buf.dispatch_wire).quantized:  # the op's rows went through the quantized wire: take the raw
        # rows' values (tritonep.ep.autograd._dispatch_rows), keeping the op's graph (the same linear map P)
        rows = _ValuesOf.apply(rows, _dispatch_rows(buf._backend, handle, u.detach(), None)[0])
    return rows, w


class _ValuesOf(torch.autograd.Function):
    """``(a, b) -> b``'s values with ``a``'s derivatives (identity backward to ``a``): ``a`` and ``b`` are the same
    linear map of the same input, ``b`` computed without rounding its rows."""

    @staticmethod
    def forward(ctx, a, b):
        return b.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def _dispatch_backward_setup(ctx, inputs, output):
    _g, grad_recv_w, ticket, bid, _T = inputs
    ctx.save_for_backward(ticket)
    ctx.buffer_id, ctx.has_w = bid, grad_recv_w is not None


def _dispatch_backward_backward(ctx, u, v):
    (ticket,) = ctx.saved_tensors
    rows, w = _redispatch(ticket, ctx.buffer_id, u, v if ctx.has_w else None)
    return rows, (w if ctx.has_w else None), None, None, None


dispatch_backward_op.register_autograd(_dispatch_backward_backward, setup_context=_dispatch_backward_setup)


# ------------------------------------------------------------------------------------------------ combine
@torch.library.custom_op("tritonep::combine", mutates_args=())
def combine_op(expert_out: torch.Tensor, recv_weights: torch.Tensor, ticket: torch.Tensor, buffer_id: int,
               num_tokens: int) -> torch.Tensor:
    """:meth:`EPBuffer.combine` of the dispatch ``ticket`` names (module docstring): ``y [num_tokens, H]``."""
    y = get_buffer(buffer_id).combine(expert_out, get_handle(ticket), forward_ad=False)  # a dual input: refused
    # a view of a pooled block (decode, tritonep/runtime/pool.py): the op's autograd would refuse in-place ops on it
    return y.detach() if y._base is not None else y


@combine_op.register_fake
def _combine_fake(expert_out, recv_weights, ticket, buffer_id, num_tokens):
    return expert_out.new_empty(num_tokens, expert_out.shape[1])


@torch.library.custom_op("tritonep::combine_backward", mutates_args=())
def combine_backward_op(grad_y: torch.Tensor, expert_out: torch.Tensor, ticket: torch.Tensor,
                        buffer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_expert_out [R, H], grad_recv_weights [R] f32)`` of a combine (:meth:`EPBuffer.combine_backward`)."""
    _refuse_tangents("tritonep::combine_backward", grad_y, expert_out)
    return get_buffer(buffer_id).combine_backward(grad_y, expert_out, get_handle(ticket))


@combine_backward_op.register_fake
def _combine_backward_fake(grad_y, expert_out, ticket, buffer_id):
    return torch.empty_like(expert_out), expert_out.new_empty(expert_out.shape[0], dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    expert_out, recv_weights, ticket, bid, _T = inputs
    ctx.save_for_backward(expert_out, ticket, recv_weights)
    ctx.buffer_id, ctx.w_dtype = bid, recv_weights.dtype


def _combine_backward(ctx, grad_y):
    expert_out, ticket, recv_weights = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable in grad_y, the row weights and the expert rows
        pg, _ = _redispatch(ticket, ctx.buffer_id, grad_y, None)
        R = pg.shape[0]
        g_eo = (recv_weights[:R, None].float() * pg.float()).to(expert_out.dtype)
        if expert_out.shape[0] > R:
            g_eo = torch.cat([g_eo, g_eo.new_zeros(expert_out.shape[0] - R, g_eo.shape[1])])
        g_w = (pg.float() * expert_out[:R].float()).sum(-1)
        if recv_weights.shape[0] > R:
            g_w = torch.cat([g_w, g_w.new_zeros(recv_weights.shape[0] - R)])
        return g_eo, g_w.to(ctx.w_dtype), None, None, None
    g_eo, g_w = torch.ops.tritonep.combine_backward(grad_y.to(expert_out.dtype).contiguous(), expert_out, ticket,
                                                    ctx.buffer_id)
    return g_eo, g_w.to(ctx.w_dtype), None, None, None


combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ------------------------------------------------------------------------------------------------ functional forms
class OpDispatched(NamedTuple):
    """What :func:`dispatch` returns (a NamedTuple of tensors and ints, so compiled code can carry it).

    Attributes:
        x: ``[R, H]`` bf16 expert-grouped rows (``R = max_recv_tokens`` with ``sync_free``, tail unspecified).
        weights: ``[R]`` float32 router weight per row (zero past the real rows); differentiable.
        num_tokens_per_expert: ``[L]`` int32 real rows per local expert (device).
        expert_offsets: ``[L]`` int32 cumulative aligned segment ends (``offs`` of ``torch._grouped_mm``).
        ticket: 0-dim int64 CPU tensor naming the dispatch handle (keep it until combine and backward ran).
        buffer_id: the buffer's op id. num_tokens: T of the dispatch.
    """

    x: torch.Tensor
    weights: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    ticket: torch.Tensor
    buffer_id: int
    num_tokens: int


def dispatch(bid: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
             sync_free: bool = False) -> OpDispatched:
    """:meth:`EPBuffer.dispatch` through ``tritonep::dispatch`` (differentiable w.r.t. ``x`` and ``topk_weights``).

    Args:
        bid: the buffer's op id (:func:`buffer_id`). x, topk_idx, topk_weights, sync_free: as
            :meth:`EPBuffer.dispatch` (``keep_quantized`` is not offered: quantized rows are not differentiable).

    Raises: what :meth:`EPBuffer.dispatch` raises; ConfigError for an unknown ``bid``.
    """
    rows, w, layout, ticket = torch.ops.tritonep.dispatch(x, topk_idx, topk_weights, bid, sync_free)
    L = layout.shape[0] // 2
    return OpDispatched(rows, w, layout[:L], layout[L:], ticket, bid, x.shape[0])


def combine(expert_out: torch.Tensor, d: OpDispatched) -> torch.Tensor:
    """:meth:`EPBuffer.combine` through ``tritonep::combine``: ``y [T, H]`` (differentiable w.r.t. ``expert_out``
    and, through ``d.weights``, the dispatch's ``topk_weights``).

    Raises: what :meth:`EPBuffer.combine` raises; BufferStateError when ``d.ticket`` no longer names a handle.
    """
    return torch.ops.tritonep.combine(expert_out, d.weights, d.ticket, d.buffer_id, d.num_tokens)
