"""MoELayer: router -> dispatch -> grouped expert FFN -> combine (+ shared experts) on one :class:`tritonep.EPBuffer`
(docs/moe.md).

The router is the recipe's (:class:`tritonep.moe.RouterConfig`: softmax top-k as Mixtral / Qwen / OLMoE, or
DeepSeek-V3's sigmoid + correction bias + group-limited top-k); shared experts (geometry ``shared_intermediate``) run
beside the routed ones in plain torch; the switch-style aux loss is attached to the output when configured
(:mod:`tritonep.moe.losses`). Parameters, gradients across DP x EP and the checkpoint keys: :mod:`tritonep.moe.params`.
Several forwards may precede their backwards (activation recompute, pipeline micro-batches): :mod:`tritonep.moe.saved`.

One forward and one backward: every call (eager or under ``torch.compile``) runs the body after the router through
the custom op of :mod:`tritonep.moe.ops`, whose forward is :meth:`MoELayer._forward_raw` and whose hand-written
backward (:meth:`MoELayer._backward_raw`) chains the backward halves of combine, the expert FFN and dispatch, so
autograd gives the gradients of ``x``, the routing weights (hence the router), ``w1`` and ``w2``.

With ``balance='virtual'`` (:mod:`tritonep.balance`) the routes are remapped to 2L runtime experts per rank (L native,
then L virtual slots) and the expert GEMMs run as a split run (:func:`tritonep.moe.experts.expert_ffn_parts_forward`):
the native rows ``[0, expert_offsets[L-1])`` with ``w1`` / ``w2`` themselves, the rows after them with zero-copy
views of only the ``n`` slots this rank uses. The counts exchange and the weight transport are the backend's
(:meth:`tritonep.EPBuffer.counts_exchange`, :meth:`tritonep.EPBuffer.expert_transport`), so virtual experts run on
either backend with the same bits. One small host read per step (runtime offsets, the placement's
``experts_to_copy``, held experts) decides the split and gives the nccl transport its split sizes. Weight bytes
moved per step and rank beyond ``balance='none'`` (``S`` = bytes of one expert's w1 + w2 = 3*H*I*itemsize, ``m`` =
copies this rank pushes, ``n`` = slots it uses, ``h`` = its native experts run elsewhere): push ``m*S``, slot GEMM
reads ``n*S``, slot weight gradients ``n*S`` written and staged once more, pull ``(copies of its experts)*S`` read
plus ``2*h*S`` for the in-place add into the native gradient.

Host protocol (docs/protocols.md (host protocol rule)): forward and backward launch the same signalling kernels and run the same host
collectives in the same order on every rank, whatever its T (0 included), routes, used slots (0 included) or held
experts: counts exchange, plan, dispatch, push, combine; backward: combine-backward, the pull, dispatch-backward (one
backward function, so the order is fixed). The split run's torch GEMMs depend on the data (a part with no rows runs
none) but they signal nothing.

Idea sources: the DeepEP / Megatron-LM MoE layer split (router, token dispatcher, grouped GEMM experts).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ..ep import EPBuffer
from ..ep.autograd import has_tangent
from ..ep.config import agree
from ..ep.validate import check_dispatch_inputs, check_expert_ids
from ..errors import BufferStateError, CapacityError, ConfigError, InputError, TritonEPError
from . import ops
from .experts import expert_ffn_parts_backward, expert_ffn_parts_forward
from .layer_parts import (_ACT_DTYPE, cancel_unread_refusal, combine_grad, expert_shapes, expert_weights,
                          layer_required_bytes, take_part_failed_backward, take_part_refused)
from .layer_status import consume_refusal, strict_check
from .layer_virtual import plan_routes, read_split, row_parts
from .losses import attach_aux_loss, switch_aux_loss
from .params import (EXPERT_WEIGHTS, expert_load_state_dict_post_hook, expert_load_state_dict_pre_hook,
                     expert_parameters, expert_state_dict_hook, local_expert_ids)
from .recipe import MoEGeometry, MoERecipe, check_config
from .routers import build_router
from .saved import SavedForwards
from .shared import SharedExperts

__all__ = ["MoELayer"]

class MoELayer(nn.Module):
    """Expert-parallel MoE layer for one EP group.

    Args:
        recipe: :class:`MoERecipe` (wires, combine kind, balance, expert alignment, router, saved forwards).
        geometry: :class:`MoEGeometry` (hidden H, intermediate I, num_experts E, topk K, max_tokens_per_rank,
            expert activation, shared experts).
        group: the EP process group (world_size W; E must be a multiple of W; rank r owns experts
            ``[r*L, (r+1)*L)``, L = E / W).
        device: where parameters and buffers live (default: the current CUDA device, else CPU).
        dtype: expert (and shared expert) weight dtype, ``torch.bfloat16`` (default) or ``torch.float32``;
            activations travel as bf16.
        seed: initialisation seed; the router weight and every expert's weights depend only on (seed, global
            expert id), so every rank builds the same router and a dense reference can rebuild all E experts
            (:meth:`init_expert_weights`).
        record_stats: fill ``last_timings`` and ``last_stats["num_tokens_per_expert"]`` after each forward. It
            synchronises the device around every phase and reads the counts back, so it is off by default (the
            forward then has only the dispatch's own host reads).
        timeout_s: bound of every in-kernel wait of the layer's EPBuffer, counts exchange and weight transport, in
            seconds (default: ``TRITONEP_TIMEOUT_S``).
        backend: the EPBuffer backend (``"auto"`` | ``"triton"`` | ``"nccl"``); the counts exchange and weight
            transport of virtual experts are that backend's, with the same results on every backend.

    Initial expert weights are drawn on the layer's device (one generator per expert, seeded by ``(seed, expert)``):
    identical for any world size on one device type, and a GPU layer never draws on the host (at DeepSeek-V3 sizes
    that took minutes). CUDA and CPU draws differ in bits: build a dense reference with
    :meth:`init_expert_weights` on the layer's device type.

    Parameters: ``router.weight [E, H]`` float32 (replicated; ``nn.Linear`` layout), ``w1 [L, H, width]``,
    ``w2 [L, I, H]`` (this rank's experts, global ids :attr:`expert_ids`; for a gated activation w1's first I output
    columns are the gate, the last I the up projection), ``shared.*`` (replicated shared experts, when configured).
    :meth:`expert_parameters` / :meth:`replicated_parameters` split them; :func:`tritonep.moe.reduce_gradients`
    reduces their gradients over DP x EP; ``state_dict()`` keys the experts by global id (``experts.<e>.w1``), so
    ``torch.distributed.checkpoint`` saves every expert once and loads at any EP size (:mod:`tritonep.moe.params`).

    Attributes after each forward: ``last_stats`` dict with ``recv_rows`` (int) and with ``balance='virtual'``
    ``slots_used`` (int); with ``record_stats`` also ``num_tokens_per_expert`` (host list of L ints; 2L runtime
    experts with ``balance='virtual'``) and ``last_timings``, a dict of seconds ``dispatch_s``, ``gemm_s``,
    ``combine_s``, and with ``balance='virtual'`` ``balance_s`` (counts exchange, plan, split read and weight push)
    (device synchronised around each phase on CUDA; host wall clock on CPU), else ``{}``; ``last_placement`` (the
    step's :class:`tritonep.balance.Placement` or None); ``last_aux_loss`` (detached 0-dim tensor of the last training
    forward's switch aux loss when ``recipe.router.aux_loss_coef > 0``, else None).

    Raises:
        ConfigError: any inconsistent recipe / geometry / world (checked before anything is allocated, naming the
            field), an unsupported dtype.
    """

    expert_parallel_weights = EXPERT_WEIGHTS  # the parameters that differ per rank (tritonep.moe.params)

    def __init__(self, recipe: MoERecipe, geometry: MoEGeometry, group, *, device=None,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, record_stats: bool = False,
                 timeout_s: float | None = None, backend: str = "auto"):
        super().__init__()
        self.record_stats = bool(record_stats)
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        err = None
        try:  # every static check before the first collective; the verdicts are exchanged in it
            check_config(recipe, geometry, world_size)
            if dtype not in (torch.bfloat16, torch.float32):
                raise ConfigError(f"MoELayer dtype={dtype} is not torch.bfloat16 or torch.float32")
        except TritonEPError as e:
            err = e
        agree(group, None if err else dict(recipe=repr(recipe), geometry=repr(geometry), dtype=str(dtype),
                                           backend=backend), err, what="MoELayer")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.recipe, self.geometry, self.group = recipe, geometry, group
        self.rank, self.world_size = rank, world_size
        self.num_local_experts = geometry.num_experts // world_size
        g = geometry
        self.router = build_router(recipe.router, g.hidden, g.num_experts, g.topk, seed=seed, device=self.device)
        w1, w2 = MoELayer._expert_weights(geometry, seed, dtype, self.expert_ids, self.device)
        self.w1 = nn.Parameter(w1)
        self.w2 = nn.Parameter(w2)
        self.shared = SharedExperts(g.hidden, g.shared_intermediate, g.activation, g.shared_gate, seed=seed,
                                    device=self.device, dtype=dtype) if g.shared_intermediate else None
        self.virtual = recipe.balance == "virtual"
        self.timeout_s = timeout_s
        # with virtual experts every rank runs 2L runtime experts (L native, then L virtual slots): the buffer
        # dispatches over W * 2L runtime ids (tritonep.balance, docs/architecture.md)
        self.buffer = EPBuffer(group, num_experts=g.num_experts * (2 if self.virtual else 1), hidden=g.hidden,
                               max_tokens_per_rank=g.max_tokens_per_rank, topk=g.topk,
                               dispatch_wire=recipe.dispatch_wire, combine_wire=recipe.combine_wire,
                               expert_alignment=recipe.expert_alignment, max_recv_tokens=g.max_recv_tokens,
                               backend=backend, dtype=_ACT_DTYPE,
                               device=self.device, timeout_s=timeout_s)
        self.counts_x = self.transport = None
        self.last_placement = None
        if self.virtual:  # the backend's own counts exchange and weight transport
            self.counts_x = self.buffer.counts_exchange(g.num_experts)
            self.transport = self.buffer.expert_transport(
                g.num_experts, expert_shapes(g), dtype)
        self._refusal = None  # the refusal of the sync-free step in progress (_refused_step)
        self.layer_id = ops.register_layer(self)
        self._stash = SavedForwards(recipe.max_saved_forwards, f"MoELayer {self.layer_id}")
        self._closed = False
        self.last_timings: dict = {}
        self.last_stats: dict = {}
        self.last_aux_loss = None
        self.register_state_dict_post_hook(expert_state_dict_hook)
        self.register_load_state_dict_pre_hook(expert_load_state_dict_pre_hook)
        self.register_load_state_dict_post_hook(expert_load_state_dict_post_hook)

    @property
    def expert_ids(self) -> range:
        """Global ids of this rank's experts, in ``w1`` / ``w2`` order: ``range(rank * L, (rank + 1) * L)``."""
        return local_expert_ids(self)

    def expert_parameters(self):
        """This rank's expert-parallel parameters (``w1``, ``w2``): reduce their gradients over the expert DP group
        only (:func:`tritonep.moe.reduce_gradients`)."""
        return iter(expert_parameters(self))

    def replicated_parameters(self):
        """The parameters every rank holds the same copy of (router, shared experts): reduce their gradients over
        the whole DP x EP group (their gradients differ per rank after backward: each rank routed its own tokens)."""
        ids = {id(p) for p in expert_parameters(self)}
        return (p for p in self.parameters() if id(p) not in ids)

    def release_saved(self) -> None:
        """Drop every forward still waiting for its backward (:mod:`tritonep.moe.saved`); their backwards raise."""
        self._stash.clear()

    @property
    def _tickets(self):
        return self._stash._tickets

    # ------------------------------------------------------------------------------------------ static
    _expert_weights = staticmethod(expert_weights)

    @staticmethod
    def init_expert_weights(geometry: MoEGeometry, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's initial weights, as the layers of any world size on ``device``'s type build them.

        Expert e's weights depend on ``(seed, e)`` only: ``w1[e] ~ N(0, 1/H)``, ``w2[e] ~ N(0, 1/I)``, drawn on
        ``device`` by a counter-based generator (:mod:`tritonep.moe.counter_rng`; float64, rounded once to
        ``dtype``), so every GPU, whatever SM count it shows the process (MPS shares included), draws the same bits,
        and a CPU the same values up to the last bit of rare float32 roundings.

        Args:
            geometry: the layer's geometry (H, I, E). seed: the layer's seed. dtype: the layer's weight dtype.
            device: where to draw (default: CPU, the weights of CPU layers).

        Returns:
            ``(w1_all [E, H, 2I], w2_all [E, I, H])`` in ``dtype`` on ``device``.
        """
        return MoELayer._expert_weights(geometry, seed, dtype, range(geometry.num_experts), device)

    @staticmethod
    def required_bytes(recipe: MoERecipe, geometry: MoEGeometry, world_size: int,
                       device_type: str | None = None, dtype: torch.dtype = torch.bfloat16,
                       backend: str = "auto") -> int:
        """Symmetric bytes one rank's layer allocates (equals ``layer.allocated_bytes``); no group needed.

        Args:
            device_type: ``"cuda"`` or ``"cpu"`` (kernel tiles, hence scratch sizes, differ); default: cuda when
                available, else cpu.
            backend: ``"auto"`` (what it picks on one host: the first registered backend, triton) or a registered
                name (``"nccl"`` holds no symmetric memory: 0).

        Raises:
            ConfigError: as the constructor.
        """
        return layer_required_bytes(recipe, geometry, world_size, device_type, dtype, backend)

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank's layer holds (EPBuffer, plus counts exchange and slots with virtual experts)."""
        return self.buffer.allocated_bytes + sum(p.allocated_bytes for p in (self.counts_x, self.transport)
                                                 if p is not None)

    # ------------------------------------------------------------------------------------------ forward
    def _now(self) -> float:
        """Phase clock of ``last_timings``: synchronises the device, only with ``record_stats`` (else 0)."""
        if not self.record_stats:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _plan_and_dispatch(self, x, topk_idx, topk_weights):
        """Both forward paths' start: (virtual experts: plan + remap), dispatch. Returns ``(clock marks [start,
        planned, dispatched], placement or None, Dispatched)``."""
        t = [self._now()]
        placement = None
        given_idx = topk_idx
        if self.virtual:
            try:
                placement, topk_idx = plan_routes(self, topk_idx)
            except (InputError, CapacityError) as e:  # the counts exchange took part, flagged; now the dispatch
                self._take_part_refused(e, planned=True)
        t.append(self._now() if self.virtual else t[-1])
        try:
            d = self.buffer.dispatch(x, topk_idx, topk_weights, sync_free=self.recipe.sync_free)
        except (InputError, CapacityError) as e:
            if self.virtual:  # the call's counts exchange saw the same refusal: read (and clear) it too
                consume_refusal(self.counts_x)
            else:  # sync-free: this rank's own refusal raised here only; the peers go on to their combine
                cancel_unread_refusal(self.buffer, self.recipe.combine)
            if self.virtual and isinstance(given_idx, torch.Tensor) and type(e) is InputError:
                # the planner turned an id outside [-1, E) into 2E (outside the runtime range): name the given one
                check_expert_ids(given_idx, self.buffer.num_experts // 2)
            raise
        t.append(self._now())
        return t, placement, d

    def _take_part_refused(self, err: Exception, planned: bool = False):
        """See :func:`tritonep.moe.layer_parts.take_part_refused` (raises ``err``; clears the exchange's record)."""
        try:
            take_part_refused(self.buffer, self.counts_x if self.virtual and not planned else None, err,
                              self.recipe.sync_free, self.recipe.combine, self.virtual)
        finally:
            if self.virtual:
                consume_refusal(self.counts_x)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``y[t] = sum_k topk_weights[t, k] * expert(topk_idx[t, k])(x[t])`` (``+ shared(x)[t]``) across the EP
        group, for every token ``t`` of ``x``'s leading dimensions.

        Collective: every rank of the group calls it (T may be 0 on some ranks).

        Args:
            x: ``[..., H]`` (e.g. transformers' ``[B, S, H]``; T = the product of the leading dimensions,
                ``T <= max_tokens_per_rank``) bfloat16, float16 or float32. The router and the shared experts see
                ``x`` as given; the tokens travel and meet the experts as bfloat16 (the expert rows' dtype).
            topk_idx, topk_weights: ``[..., K]`` routing (int64 ids in ``[-1, E)``, float32 weights; the leading
                dimensions as ``x``'s) to use instead of the router (e.g. a real trace); give both or neither.

        Returns:
            ``x``'s shape and dtype (the routed and shared sums added in float32, rounded once to ``x``'s dtype),
            differentiable w.r.t. x, topk_weights (router weight when routed here), w1, w2 and the shared experts;
            with ``recipe.router.aux_loss_coef > 0`` (training, routed here) its backward also adds the aux loss's
            gradient (:mod:`tritonep.moe.losses`). Training with ``recipe.router.jitter_noise > 0`` multiplies ``x``
            by uniform noise in ``[1 - eps, 1 + eps]`` first (Mixtral's ``router_jitter_noise``: router and experts
            see the same jittered tokens).

        Raises:
            InputError: only one routing tensor given, ``x`` not ``[..., H]`` or of another dtype, or bad routing
                shapes / dtypes (see ``EPBuffer.dispatch``), or a forward-mode dual tensor among ``x``, the routing
                weights, ``w1``, ``w2`` (no forward-mode derivative); raised on every rank (the others:
                PeerInputError).
            CapacityError, PeerTimeoutError, BufferStateError: from the buffer. PlanError: from the planner.
        """
        if self._closed:
            raise BufferStateError("MoELayer is closed")
        routed = None
        shape = dtype = None
        given = (x, topk_weights)
        try:
            if (topk_idx is None) != (topk_weights is None):
                raise InputError("give both topk_idx and topk_weights, or neither (then the router routes)")
            if not isinstance(x, torch.Tensor):
                raise InputError(f"x must be torch.Tensor, got {type(x).__name__}")
            shape, dtype = x.shape, x.dtype
            x = self._tokens(x)
            if topk_idx is not None:
                topk_idx, topk_weights = (self._routing(t, shape) for t in (topk_idx, topk_weights))
            eps = self.recipe.router.jitter_noise
            if eps > 0 and self.training:
                x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
            if topk_idx is None:
                routed = self.router(x, full=True)
                topk_idx, topk_weights = routed.topk_idx, routed.topk_weights
            bad = [n for n, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights))
                   if not isinstance(t, torch.Tensor)]
            if bad:
                raise InputError(f"{', '.join(bad)} must be torch.Tensor, got "
                                 f"{[type(t).__name__ for t in (topk_idx, topk_weights)]}")
            if has_tangent(x, topk_weights, self.w1, self.w2):
                raise InputError("MoELayer has no forward-mode derivative: x, the routing weights or w1 / w2 is a "
                                 "dual tensor (torch.autograd.forward_ad), whose tangent the layer's one custom op "
                                 "would lose; use EPBuffer.dispatch / combine around torch experts, which carry "
                                 "tangents exactly")
            xb = x if x.dtype == _ACT_DTYPE else x.to(_ACT_DTYPE)  # the tokens travel as bf16
            if self.recipe.sync_free:  # the buffer's own input checks, here: a refusal is deferred (_refused_step)
                b = self.buffer
                check_dispatch_inputs(xb, topk_idx, topk_weights, b.hidden, b.topk, b.max_tokens_per_rank,
                                      _ACT_DTYPE, b.device)
        except (InputError, CapacityError) as e:  # every rank fails this call together (docs/protocols.md (host protocol rule))
            if self.recipe.sync_free and isinstance(given[0], torch.Tensor):
                return self._refused_step(e, *given, routed)
            self._take_part_refused(e)
        save = torch.is_grad_enabled() and any(t.requires_grad for t in (xb, topk_weights, self.w1, self.w2))
        y, _ticket = ops.moe_layer_forward(xb, topk_idx, topk_weights, self.w1, self.w2, self.layer_id, save)
        if self.shared is not None:
            y = y.float() + self.shared(x).float()
        y = y.to(dtype)
        if y.shape != shape:
            y = y.reshape(shape)
        coef = self.recipe.router.aux_loss_coef
        if routed is not None and coef > 0 and self.training and torch.is_grad_enabled():
            aux = switch_aux_loss(routed.probs, topk_idx, self.geometry.num_experts)
            self.last_aux_loss = aux.detach()
            y = attach_aux_loss(y, aux, coef)
        return y

    def _refused_step(self, err: Exception, x: torch.Tensor, topk_weights, routed) -> torch.Tensor:
        """A sync-free forward whose input this rank refused (``err``): no rank reads anything in this step, so this
        rank does not raise now but runs the step as its peers do, the same collectives forward and backward: its
        dispatch takes part as refused (:meth:`tritonep.EPBuffer.refuse_dispatch`, T = 0 tokens), its combine as
        refused (the peers' output NaN), and the returned ``y`` is NaN in ``x``'s shape, in the autograd graph of
        ``x`` and of the layer's op exactly when the peers' output is (so the backward runs on every rank, moving
        no row). The next ``layer.buffer.check()`` raises ``err`` here and :class:`PeerInputError` naming this
        rank elsewhere. A rank that raised at once instead would leave its peers' backward and next step without
        it (desynchronised collectives: hangs, or an aborted process on the nccl backend)."""
        H, K, dev = self.geometry.hidden, self.geometry.topk, self.device
        w_grad = topk_weights.requires_grad if isinstance(topk_weights, torch.Tensor) else \
            (routed is not None or topk_weights is None) and self.router.weight.requires_grad
        grad = torch.is_grad_enabled()
        xb0 = torch.empty(0, H, dtype=_ACT_DTYPE, device=dev, requires_grad=grad and x.requires_grad)
        w0 = torch.empty(0, K, dtype=torch.float32, device=dev, requires_grad=grad and bool(w_grad))
        idx0 = torch.empty(0, K, dtype=torch.int64, device=dev)
        save = grad and any(t.requires_grad for t in (xb0, w0, self.w1, self.w2))
        self._refusal = err
        try:
            y0, _ticket = ops.moe_layer_forward(xb0, idx0, w0, self.w1, self.w2, self.layer_id, save)
        finally:
            self._refusal = None
        nan = float("nan")
        y = x * nan if x.is_floating_point() else torch.full(x.shape, nan, device=x.device)
        keep = y0.sum() * 0  # y0 (no row) keeps the op's backward in the graph
        if routed is not None:  # the router's and the shared experts' parameters get (NaN) gradients as on the peers
            keep = keep + routed.topk_weights.sum() * 0
        if self.shared is not None and x.is_floating_point() and x.dim() >= 1 and x.shape[-1] == H:
            keep = keep + self.shared(x.reshape(-1, H)).float().sum() * 0
        return y + keep.to(y.dtype)

    _INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` as ``[T, H]`` (a view when possible). Raises InputError naming the shape or dtype."""
        H = self.geometry.hidden
        if x.dim() < 1 or x.shape[-1] != H:
            raise InputError(f"x must be [..., hidden={H}], got shape {tuple(x.shape)}")
        if x.dtype not in self._INPUT_DTYPES:
            raise InputError(f"x has dtype {x.dtype}; the layer takes {[str(d) for d in self._INPUT_DTYPES]}")
        return x if x.dim() == 2 else x.reshape(-1, H)

    def _routing(self, t, shape) -> torch.Tensor:
        """A routing tensor ``[..., K]`` whose leading dimensions are ``x``'s (``shape``) as ``[T, K]``; anything
        else is returned as is (the dispatch's checks name it)."""
        if isinstance(t, torch.Tensor) and t.dim() != 2 and t.dim() == len(shape) and t.shape[:-1] == shape[:-1]:
            return t.reshape(-1, t.shape[-1])
        return t

    def _record(self, t, d, split):
        # t: start, planned, dispatched, pushed, gemm done, combined
        self.last_stats = {"recv_rows": d.x.shape[0]}
        self.last_timings = {}
        if split is not None:
            self.last_stats["slots_used"] = split.num_used
        if self.record_stats:
            self.last_stats["num_tokens_per_expert"] = d.num_tokens_per_expert.tolist()
            self.last_timings = {"dispatch_s": t[2] - t[1], "gemm_s": t[4] - t[3], "combine_s": t[5] - t[4]}
            if split is not None:
                self.last_timings["balance_s"] = (t[1] - t[0]) + (t[3] - t[2])

    def _forward_raw(self, x, topk_idx, topk_weights, w1, w2, save: bool):
        """The layer's one forward (run by the custom op, eager or compiled); returns ``(y, ticket)`` and keeps the
        backward state of this call if ``save`` (:class:`tritonep.moe.saved.SavedForwards`: forwards still waiting
        for their backward have their shared tensors copied out first, as this call overwrites them).

        ``topk_idx`` are global expert ids and ``w1`` / ``w2`` this rank's native weights in both modes; with
        virtual experts the plan, the push and the split run happen in here (the op is opaque to the tracer).
        """
        with torch.no_grad():
            self._stash.spill()  # even when this call saves nothing: it overwrites the expert output region
            if self._refusal is None:
                t, placement, d = self._plan_and_dispatch(x, topk_idx, topk_weights)
            else:  # a sync-free step this rank refused (_refused_step): the empty layout, no error now
                t, placement = [self._now()] * 3, None
                d = self.buffer.refuse_dispatch(self._refusal, sync_free=True)
            split = None
            w1s, w2s = (w1,), (w2,)
            if self.virtual:
                split = read_split(self, d.expert_offsets, placement, topk_idx)
                self.transport.push({"w1": w1, "w2": w2}, placement, split.experts_to_copy)
                strict_check(self.transport, self.buffer)
                views = self.transport.slot_views(split.num_used)
                w1s, w2s = (w1, views["w1"]), (w2, views["w2"])
            t.append(self._now() if self.virtual else t[-1])
            failed = False
            try:
                bounds, offs = row_parts(self, d, split)
                eo, hs = expert_ffn_parts_forward(d.x, bounds, offs, w1s, w2s,
                                                  self.buffer.expert_out_buffer(d.x.shape[0]),
                                                  self.geometry.activation)
            except Exception as exc:  # this rank failed between dispatch and combine (e.g. out of memory in its
                # experts): it still takes part in the combine, so the peers fail the call at once instead of
                # waiting for it
                self.buffer.cancel_combine(d.handle, kind=self.recipe.combine)
                if self.buffer.last_dispatch_read or self.virtual:
                    raise  # the peers raise PeerInputError in this combine: every rank leaves the step here
                # nothing read (sync-free): the peers raise nothing and run their backward and next step, so this
                # rank does too, with NaN and the same collectives, and raises exc at its next check()
                self.buffer.defer(exc)
                failed, bounds, offs, hs = True, None, None, None
                eo = self.buffer.expert_out_buffer(d.x.shape[0]).fill_(float("nan"))
            t.append(self._now())
            if failed:  # cancel_combine above stood for this rank's combine
                y = torch.full((x.shape[0], self.geometry.hidden), float("nan"), dtype=_ACT_DTYPE, device=x.device)
            else:
                y = self.buffer.combine(eo, d.handle, kind=self.recipe.combine)
            t.append(self._now())
        self._record(t, d, split)
        ticket = -1
        if save:
            ticket = self._stash.add(dict(xr=d.x, bounds=bounds, offs=offs, hs=hs, eo=eo, handle=d.handle,
                                          w1=tuple(w.detach() for w in w1s), w2=tuple(w.detach() for w in w2s),
                                          n_slot_parts=len(w1s) - 1, placement=placement, split=split))
        return y, ticket

    def _backward_raw(self, ticket: int, grad_y: torch.Tensor):
        """Backward of one ``_forward_raw`` call: ``(grad_x, grad_topk_weights, grad_w1, grad_w2)``.

        Chains the backward pieces of combine (``grad_expert_out``, per-row weight grads), the expert FFN and
        dispatch (sums rows back to tokens, gathers weight grads); with virtual experts the slot gradients are
        pulled back into the native ones (the backend transport's ``pull`` into them). Backwards of several saved
        forwards may come in any order (:mod:`tritonep.moe.saved`); every rank runs them in the same order.

        When this rank's own part fails (the expert FFN backward raises, e.g. out of memory; the gradient's cast
        before the combine backward), it still takes part in the rest of the backward's collectives as a cancelled
        call (:func:`tritonep.moe.layer_parts.take_part_failed_backward`), so no peer waits for it: the peers'
        ``grad_x`` / ``grad_topk_weights`` are NaN (on the nccl backend: every element computed from this rank's
        rows) and their next ``check()`` or synced dispatch raises :class:`tritonep.errors.PeerInputError` naming
        this rank; this rank raises its error here (its next read then names it too), or, with
        ``MoERecipe(sync_free=True)`` (no rank raises inside a step), returns NaN gradients and raises the error at
        its next ``check()``. The layer stays usable on every rank.

        Raises:
            BufferStateError: the call's state is gone (consumed by a backward, dropped past
                ``MoERecipe.max_saved_forwards``, or released).
            The error of this rank's own part (above).
        """
        st = self._stash.pop(ticket)
        buf, handle = self.buffer, st["handle"]  # the backward halves of dispatch / combine (as tritonep.ep.autograd)
        try:
            gy = combine_grad(grad_y)
        except Exception as exc:  # nothing launched yet: the combine backward takes part cancelled too
            buf.cancel_combine_backward(handle)
            return take_part_failed_backward(self, exc, st)
        try:
            g_eo, g_rw = buf.combine_backward(gy, st["eo"], handle)
        except (InputError, ConfigError) as exc:  # refused here: it took part as refused
            return take_part_failed_backward(self, exc, st)
        try:
            if st["bounds"] is None:  # this rank's experts failed in the forward (its error deferred to check()):
                # the same collectives as the peers, NaN gradients (they cannot pass for a result)
                nan = float("nan")
                g_xr = torch.full_like(st["xr"], nan)
                g_w1, g_w2 = (torch.full_like(st["w1"][0], nan),), (torch.full_like(st["w2"][0], nan),)
            else:
                g_xr, g_w1, g_w2 = expert_ffn_parts_backward(g_eo, st["xr"], st["bounds"], st["offs"], st["w1"],
                                                             st["w2"], st["hs"], self.geometry.activation)
        except Exception as exc:  # this rank's experts failed in the backward: the rest takes part cancelled
            return take_part_failed_backward(self, exc, st)
        if self.virtual:
            sp = st["split"]
            g = self.transport.pull({"w1": g_w1[1], "w2": g_w2[1]}, st["placement"], sp.num_used, sp.held,
                                    into={"w1": g_w1[0], "w2": g_w2[0]}, experts_to_copy_host=sp.experts_to_copy)
            strict_check(self.transport, self.buffer)
            g_w1, g_w2 = (g["w1"],), (g["w2"],)
        g_x, g_tw = buf.dispatch_backward(g_xr, g_rw, handle)
        return g_x, g_tw, g_w1[0], g_w2[0]

    # ------------------------------------------------------------------------------------------ lifetime
    def close(self):
        """Release in order: saved backward state, the op registry entry, then the EPBuffer (collective: every rank
        closes its layers in the same order). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stash.clear()
        ops.unregister_layer(self.layer_id)
        for part in (self.transport, self.counts_x):
            if part is not None:
                part.close()
        self.buffer.close()

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}, geometry={self.geometry}, rank={self.rank}/{self.world_size}"
