"""torchtitan token dispatcher over :class:`tritonep.EPBuffer` (torchtitan 0.3.0; ``pip install -e '.[torchtitan]'``).

torchtitan's MoE (``torchtitan.models.common.moe``) runs ``RoutedExperts``: ``token_dispatcher.dispatch`` ->
``GroupedExperts`` (``torch._grouped_mm`` with ``offs = cumsum(num_tokens_per_local_expert)``) ->
``token_dispatcher.combine``, and lets the dispatcher be swapped (``BaseEPTokenDispatcher``).
:class:`TritonEPTokenDispatcher` is that dispatcher on tritonep:

* ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)`` ->
  ``(routed_input_RD, num_tokens_per_local_expert_e, metadata)``: the expert-major rows of this rank's experts
  (segment j = local expert j, rows ordered by (source rank, token, k)), ``num_tokens_per_local_expert_e`` int64
  ``[L]`` = the segment lengths, so torchtitan's ``cumsum`` gives back :attr:`tritonep.Dispatched.expert_offsets`
  (with ``pad_multiple`` the lengths include the zero padding rows, as torchtitan's padded dispatchers do).
  ``num_local_tokens_per_expert_E`` is not used: the counts exchange runs on the device inside the dispatch.
* ``sync_free=True`` (default): no host read (torchtitan's contract for its sync-free backends: same padded T on
  every rank, device counts): ``R = max_recv_tokens`` rows, the real ones ``[0, sum(counts))``; the grouped GEMM
  only reads rows inside its offsets, and combine / the backward only read real rows, so the tail's content
  (unspecified) never reaches a result. ``sync_free=False``: exactly the received rows (one host read per
  dispatch).
* ``combine(routed_output_RD, metadata, x_TD)`` -> ``out_TD``: the weighted sum ``sum_k score[t,k] *
  expert_out[row(t,k)]`` (fp32 accumulation, one rounding to bf16, fixed order), cast to ``x_TD.dtype``. Gradients
  flow to ``x_TD``, the routing scores (hence the router) and the expert outputs.
* dispatch and combine go through the ``tritonep::dispatch`` / ``tritonep::combine`` custom ops
  (:mod:`tritonep.ep.ops`: fake implementations, registered backward), so ``torch.compile(fullgraph=True)`` (what
  torchtitan's ``--compile.enable`` applies per block) traces through them, and activation checkpointing recomputes
  them like any op (a recomputed dispatch is a collective that every rank recomputes in the same order).

Selecting it (torchtitan 0.3.0 has no registry of ``comm_backend`` names: ``make_token_dispatcher_config`` is an
if/else). torchtitan's own component-swap mechanism is ``--override.imports`` (``torchtitan.config.override``,
applied to the config tree after ``update_from_config`` and before the model is built)::

    --override.imports 'tritonep.integrations.torchtitan.tritonep_token_dispatcher={"num_max_tokens_per_rank": 8192}'
    --training.disable_cuda_graphs

replaces every MoE token dispatcher config (any ``comm_backend``) by :class:`TritonEPTokenDispatcher.Config`. The
kwargs are the Config's fields (``dispatch_wire``, ``combine_wire``, ``pad_multiple``, ``sync_free``,
``max_recv_tokens``, ``num_sms``, ``backend``, ``hidden_dim``, ``num_max_tokens_per_rank``). In a Python config function, or on a
model config built by hand, :func:`use_tritonep` does the same. ``--training.disable_cuda_graphs``: torchtitan
0.3.0's ``Trainer.Config._validate_cuda_graphs`` accepts only its own MinimalAsyncEP / non-blocking HybridEP
dispatchers under its whole-step CUDA graph, whatever a dispatcher's sync behaviour.

Buffer sizing: ``hidden_dim`` and ``num_max_tokens_per_rank`` (torchtitan's rule: ``local_batch_size * seq_len /
(cp * tp)``) size the buffer when the EP mesh is wired (``init_buffer``, collective). If either is unknown then (the
override copies them from the matched config when torchtitan filled them, i.e. for ``comm_backend`` ``"hybridep"`` /
``"deepep"`` / ``"minimal_async_ep"``), the buffer is built at the first dispatch from ``x_TD``'s shape, which
torchtitan pads to the same T on every rank; under ``torch.compile`` that first call is traced, so compiled runs must
give both. Dispatchers with the same static configuration share one buffer (one symmetric allocation for all MoE
layers of a stage); :func:`close_buffers` frees them.

Virtual experts (``tritonep.MoERecipe(balance="virtual")``) cannot be expressed through this contract: they give a
rank 2L runtime experts, L native plus L slots that hold copies of other ranks' experts chosen per step, so the
grouped GEMM needs ``2L`` weight matrices, the owners' weights pushed into the slots before it and the slots'
weight gradients pulled back and added to the owners' after it. torchtitan's dispatcher never sees the expert
weights (they are ``GroupedExperts.w1_EFD/w2_EDF/w3_EFD`` of the sibling ``inner_experts`` module, sharded
``[L, ...]`` per rank) and ``GroupedExperts.forward(x_RD, num_tokens_per_expert)`` takes no placement. What would be
needed: a ``GroupedExperts`` subclass (``RoutedExperts.inner_experts`` is swappable) that receives the step's
placement from the dispatcher's metadata (``RoutedExperts.forward`` passes only rows and counts today, so either a
third argument there or a shared per-step object), runs the 2L-segment GEMM over its native weights plus the slot
copies (:meth:`tritonep.EPBuffer.expert_transport`), and pulls the slot gradients back in its backward, plus an
FSDP-aware view of the local expert shards. No switch is offered until that exists.

Idea sources: torchtitan's ``MinimalAsyncEPTokenDispatcher`` / ``HybridEPTokenDispatcher`` (config fields, one
process-wide buffer, sync-free static capacity), DeepEP's ``num_worst_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchtitan.config.override import override
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher, LocalTokenDispatcher

import tritonep
from tritonep.errors import ConfigError
from tritonep.ep import ops

__all__ = ["TritonEPTokenDispatcher", "TritonEPDispatchMetadata", "tritonep_token_dispatcher", "use_tritonep",
           "shard_routed_experts", "close_buffers"]

_BUFFERS: dict = {}  # static configuration -> EPBuffer, shared by every dispatcher of that configuration


@dataclass(frozen=True, kw_only=True)
class TritonEPDispatchMetadata:
    """What :meth:`TritonEPTokenDispatcher.dispatch` hands to ``combine``.

    Attributes:
        recv_weights: float32 ``[R]`` routing score of every received row (0 past the real rows); carries the
            scores' gradient.
        ticket: 0-dim int64 CPU tensor naming the dispatch handle (:mod:`tritonep.ep.ops`).
        buffer_id: the buffer's op id. num_tokens: T.
    """

    recv_weights: torch.Tensor
    ticket: torch.Tensor
    buffer_id: int
    num_tokens: int


class TritonEPTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan ``BaseEPTokenDispatcher`` over :class:`tritonep.EPBuffer` (see the module docstring).

    Raises:
        ConfigError: no EP mesh (``expert_parallel_degree`` 1), a bad field (wires and sizes are checked by
            :class:`tritonep.EPBuffer` when the buffer is built), an unsized buffer under ``torch.compile``.
        What :meth:`tritonep.EPBuffer.dispatch` / ``combine`` raise (CapacityError for ``T >
        num_max_tokens_per_rank``, PeerTimeoutError, ...); with ``sync_free`` a device-side error (a timeout) is
        raised by the next :meth:`check` or synced call.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        """Fields besides ``num_experts`` / ``top_k``.

        Attributes:
            hidden_dim: H (model dim); None: taken from the first dispatch's ``x_TD``.
            num_max_tokens_per_rank: capacity of T per rank; None: the first dispatch's T.
            dispatch_wire / combine_wire: ``"bf16"`` | ``"fp8"`` | ``"mxfp4"`` | ``"fp8_e5m2"``
                (:data:`tritonep.wire.WIRES`); the experts always get bf16 rows.
            pad_multiple: every expert segment starts at a multiple of this (zero padding rows), for padded
                (fp8 / mxfp8) grouped GEMMs; None = 1.
            sync_free: no host read per dispatch (``max_recv_tokens`` rows, device counts); every backend offers
                it (the nccl one moves fixed per-peer packet slots with one equal-split all_to_all).
            max_recv_tokens: rows one rank can receive; None = the buffer's default, the worst case
                ``W * Tmax * K + L * (A-1)`` (:class:`tritonep.ep.config.EPConfig`: duplicate ids in a row are two
                routes, so one token can send K rows to one rank).
            num_sms: cap on the programs of every communication kernel (None: the kernel-tile table).
            backend: the EPBuffer backend (``"auto"``, the default: the symmetric-memory one when every rank of
                the EP group maps every peer's memory, else the ``torch.distributed`` one; or a registered name).
                The dispatcher needs nothing of a particular backend: both give the same rows, and the custom ops
                (:mod:`tritonep.ep.ops`) take either.
        """

        hidden_dim: int | None = None
        num_max_tokens_per_rank: int | None = None
        dispatch_wire: str = "bf16"
        combine_wire: str = "bf16"
        pad_multiple: int | None = None
        sync_free: bool = True
        max_recv_tokens: int | None = None
        num_sms: int | None = None
        backend: str = "auto"

    def __init__(self, config: Config):
        super().__init__(config)
        for name in ("hidden_dim", "num_max_tokens_per_rank", "pad_multiple", "max_recv_tokens", "num_sms"):
            v = getattr(config, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"TritonEPTokenDispatcher.Config.{name}={v!r} is not a positive int (or None)")
        self.hidden_dim = config.hidden_dim
        self.num_max_tokens_per_rank = config.num_max_tokens_per_rank
        self.dispatch_wire, self.combine_wire = config.dispatch_wire, config.combine_wire
        self.pad_multiple = config.pad_multiple or 1
        self.sync_free = config.sync_free
        self.max_recv_tokens = config.max_recv_tokens
        self.num_sms = config.num_sms
        self.backend = config.backend
        self.buffer: tritonep.EPBuffer | None = None
        self._bid: int | None = None

    def wire_meshes(self, *, ep_mesh) -> None:
        """Install the EP mesh (a 1-D ``DeviceMesh``) and build the buffer when it is sized (collective)."""
        if ep_mesh is None:
            raise ConfigError("TritonEPTokenDispatcher needs expert parallelism (an EP mesh; torchtitan's "
                              "expert_parallel_degree > 1); use torchtitan's LocalTokenDispatcher without EP")
        super().wire_meshes(ep_mesh=ep_mesh)

    def init_buffer(self) -> None:
        """Build (or join) the shared :class:`tritonep.EPBuffer` when ``hidden_dim`` and ``num_max_tokens_per_rank``
        are known; otherwise the first dispatch builds it."""
        if self.hidden_dim is not None and self.num_max_tokens_per_rank is not None:
            self._build(self.hidden_dim, self.num_max_tokens_per_rank)

    def _build(self, hidden: int, max_tokens: int) -> None:
        group = self.ep_mesh.get_group()
        W = dist.get_world_size(group)
        if self.num_experts % W:
            raise ConfigError(f"num_experts={self.num_experts} is not a multiple of the EP degree {W}")
        A = self.pad_multiple
        key = (group, self.num_experts, hidden, max_tokens, self.top_k, self.dispatch_wire, self.combine_wire, A,
               self.max_recv_tokens, self.num_sms, self.backend)
        buf = _BUFFERS.get(key)
        if buf is None:  # every size not given is the buffer's own (EPConfig: one formula)
            buf = tritonep.EPBuffer(group, self.num_experts, hidden, max_tokens, self.top_k,
                                    dispatch_wire=self.dispatch_wire, combine_wire=self.combine_wire,
                                    expert_alignment=A, max_recv_tokens=self.max_recv_tokens, backend=self.backend,
                                    num_sms=self.num_sms)
            _BUFFERS[key] = buf
        self.buffer, self._bid = buf, ops.buffer_id(buf)
        self.hidden_dim, self.num_max_tokens_per_rank = hidden, max_tokens

    def dispatch(self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                 num_local_tokens_per_expert_E: torch.Tensor):
        """Send every token to its experts' ranks (module docstring). ``x_TD`` ``[T, D]`` (any float dtype; sent as
        bf16), ``topk_scores_TK`` ``[T, K]`` float, ``topk_expert_ids_TK`` ``[T, K]`` int64 in ``[0, E)``."""
        del num_local_tokens_per_expert_E  # the counts exchange runs on the device
        if self._bid is None:
            if self.ep_mesh is None:
                raise ConfigError("TritonEPTokenDispatcher.dispatch before wire_meshes (no EP mesh)")
            if torch.compiler.is_compiling():
                raise ConfigError("TritonEPTokenDispatcher under torch.compile needs hidden_dim and "
                                  "num_max_tokens_per_rank in its Config (the buffer is built when the mesh is wired)")
            self._build(self.hidden_dim or x_TD.shape[1], self.num_max_tokens_per_rank or x_TD.shape[0])
        x = x_TD if x_TD.dtype == torch.bfloat16 else x_TD.to(torch.bfloat16)
        d = ops.dispatch(self._bid, x, topk_expert_ids_TK, topk_scores_TK, sync_free=self.sync_free)
        offs = d.expert_offsets
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).to(torch.int64)
        meta = TritonEPDispatchMetadata(recv_weights=d.weights, ticket=d.ticket, buffer_id=d.buffer_id,
                                        num_tokens=d.num_tokens)
        return d.x, counts, meta

    def combine(self, routed_output_RD: torch.Tensor, metadata: TritonEPDispatchMetadata,
                x_TD: torch.Tensor) -> torch.Tensor:
        """Weighted combine of the expert outputs ``[R, D]`` back to ``[T, D]`` in ``x_TD``'s dtype."""
        eo = routed_output_RD if routed_output_RD.dtype == torch.bfloat16 else routed_output_RD.to(torch.bfloat16)
        y = torch.ops.tritonep.combine(eo, metadata.recv_weights, metadata.ticket, metadata.buffer_id,
                                       metadata.num_tokens)
        return y.to(x_TD.dtype)

    def check(self) -> None:
        """Raise an error the device recorded in a sync-free call (one host sync; :meth:`tritonep.EPBuffer.check`)."""
        if self.buffer is not None:
            self.buffer.check()


def _dispatcher_config(src: LocalTokenDispatcher.Config, **fields) -> TritonEPTokenDispatcher.Config:
    """Our Config for a matched torchtitan dispatcher config: ``num_experts`` / ``top_k`` (and ``hidden_dim`` /
    ``num_max_tokens_per_rank`` / ``pad_multiple`` when the source has them), then ``fields``."""
    inherited = {n: getattr(src, n) for n in ("hidden_dim", "num_max_tokens_per_rank", "pad_multiple")
                 if getattr(src, n, None) is not None}
    inherited.update(fields)
    return TritonEPTokenDispatcher.Config(num_experts=src.num_experts, top_k=src.top_k, **inherited)


@override(target=LocalTokenDispatcher.Config,
          description="tritonep EPBuffer token dispatcher (Triton over symmetric memory, sync-free)")
def tritonep_token_dispatcher(cfg: LocalTokenDispatcher.Config, **fields) -> TritonEPTokenDispatcher.Config:
    """torchtitan override factory: ``--override.imports
    'tritonep.integrations.torchtitan.tritonep_token_dispatcher={...}'`` replaces every token dispatcher config by
    :class:`TritonEPTokenDispatcher.Config` (``fields``: its fields, as JSON). Raises TypeError for an unknown field."""
    return _dispatcher_config(cfg, **fields)


def use_tritonep(model_config, **fields):
    """Replace every MoE token dispatcher config in ``model_config`` (a torchtitan model / module config, e.g.
    ``trainer_config.model_spec.model`` or one ``MoE.Config``) by :class:`TritonEPTokenDispatcher.Config` with
    ``fields``; returns ``model_config`` (changed in place). The Python twin of the override."""
    for _fqn, routed, _parent, _attr in model_config.traverse(RoutedExperts.Config):
        routed.token_dispatcher = _dispatcher_config(routed.token_dispatcher, **fields)
    return model_config


def shard_routed_experts(module, ep_mesh) -> None:
    """Expert parallelism without torchtitan's ``parallelize``: every ``RoutedExperts`` under ``module`` (a built
    torchtitan model or ``MoE``) keeps only this rank's experts ``[r*L, (r+1)*L)`` of its ``GroupedExperts`` weights
    (plain tensors, new leaf parameters) and its dispatcher gets ``ep_mesh`` (``wire_meshes``, collective).

    For tests, examples and benchmarks that run torchtitan's modules directly; a torchtitan training job shards with
    its own ``parallelize_*`` (DTensors) and wires the mesh itself. Raises ConfigError when E is not a multiple of the
    mesh size.
    """
    W, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for sub in module.modules():
        if not isinstance(sub, RoutedExperts):
            continue
        experts = sub.inner_experts
        E = experts.num_experts
        if E % W:
            raise ConfigError(f"num_experts={E} is not a multiple of the EP degree {W}")
        L = E // W
        for name, p in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, torch.nn.Parameter(p.detach()[r * L:(r + 1) * L].clone(),
                                                      requires_grad=p.requires_grad))
        sub.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)


def close_buffers() -> None:
    """Close every shared buffer (collective: every rank calls it; afterwards dispatchers must be rebuilt)."""
    for buf in list(_BUFFERS.values()):
        buf.close()
    _BUFFERS.clear()
