"""The MoE layer reads every status word its call's kernels write: nothing fails silently.

With ``balance='virtual'`` a forward runs, besides the EPBuffer (which reads its own status word), the backend's
counts exchange, the planner and the weight transport; each records errors on the device (a wait that gave up, a
refused input of some rank, a planner status bit). The layer reads them in the one host read it makes anyway per
step (:func:`tritonep.moe.layer_virtual.read_split`, no extra sync) and raises them there, before the weight push:

* the counts exchange of this call: a timeout (``PeerTimeoutError``) or a refused input (the bad rank raises
  ``InputError`` naming its value and ``(token, k)``, the others ``PeerInputError``, as ``balance='none'`` does);
* the planner of this call: its status bits (``PlanError``);
* the weight transport's push / pull since the last read (a rendezvous that gave up: ``PeerTimeoutError``). As
  for the EPBuffer (``TRITONEP_SYNC_CHECKS``, docs/protocols.md), a wait that gives up in a push or a backward's
  pull is raised at the next forward by default, and in the same call with ``TRITONEP_SYNC_CHECKS=1``
  (:func:`strict_check`).

A call that already fails (a refused dispatch) reads the counts exchange's record of the same refusal on its error
path (:func:`consume_refusal`), so it is reported once and never raised again by a later call.
"""

from __future__ import annotations

import torch

from .. import envs
from ..ep.validate import check_expert_ids
from ..errors import CapacityError, InputError, PeerInputError

__all__ = ["raise_balance_status", "consume_refusal", "strict_check"]


def raise_balance_status(layer, values: list, sizes: list, given_idx=None) -> None:
    """Raise the first error of the status words of one virtual-expert step, read on the host.

    Args:
        layer: the :class:`tritonep.MoELayer` (its ``counts_x``, ``transport``, ``rank``, ``geometry``).
        values: host ints, the concatenation of ``counts_x.status_words()``, ``placement.status`` and
            ``transport.status_words()`` (in that order).
        sizes: the three parts' lengths.
        given_idx: this rank's ``topk_idx`` of the call (global ids), to name a refused value; None: not named.

    Raises:
        PeerTimeoutError: a wait of the counts exchange (this call) or of the weight transport (its last push /
            pull) gave up. InputError: this rank's ids were refused (naming the value and ``(token, k)``).
        PeerInputError: another rank's input was refused. PlanError: a planner status bit.
    """
    from ..balance.planner import raise_plan_bits

    n_counts, n_plan, _ = sizes
    counts_v, plan_v = values[:n_counts], values[n_counts:n_counts + n_plan]
    transport_v = values[n_counts + n_plan:]
    try:
        layer.counts_x.raise_status(counts_v)
    except PeerInputError as e:
        if layer.rank in (e.bad_ranks or []) and isinstance(given_idx, torch.Tensor):
            check_expert_ids(given_idx, layer.geometry.num_experts)  # raises InputError naming the value
        raise
    bits = 0
    for v in plan_v:
        bits |= int(v)
    raise_plan_bits(bits)
    layer.transport.raise_status(transport_v)


def consume_refusal(counts_x) -> None:
    """On the error path of a refused call: read the refusal the counts exchange recorded for the same call and
    clear it (one host read), so no later call raises it again; a timeout it recorded is raised."""
    try:
        counts_x.check()
    except (InputError, CapacityError):  # the refusal this call already raises (PeerInputError is an InputError)
        pass


def strict_check(part, buffer) -> None:
    """Strict sync checks (``buffer.config.sync_checks``, the layer's EPBuffer's: TRITONEP_SYNC_CHECKS=1): read
    ``part``'s status word at the end of its call (one sync) and raise its error in that call; otherwise the next
    forward's read raises it."""
    if buffer.config.sync_checks == envs.SYNC_STRICT:
        part.check()
