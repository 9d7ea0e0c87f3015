"""The launch-sequence recorder of the CPU world: CI's check of the host protocol rule (docs/protocols.md (host protocol rule)).

Every rank of a CPU world records, in order, each recorded bound launch of a launch runtime
(:mod:`tritonep.runtime.launch`; ``("launch", kernel name, grid)``) and each ``torch.distributed`` collective it calls (``("collective", name)``,
through ``torch.distributed.<name>`` or ``torch.distributed.distributed_c10d.<name>``; a collective made of other
collectives counts once). Kernels launched directly (``kernel[grid](...)``) are not recorded: every kernel that
signals or waits on a peer must be a bound launch of a recording launch runtime, which
``tests/testing/test_protocol_recorder.py`` checks on the source.
When the world ends, :func:`compare_sequences` checks that every rank recorded the same sequence and
:func:`tritonep.testing.run_cpu_world` raises :class:`ProtocolMismatch` otherwise. On the GPU, a rank that launches a
signalling kernel or reaches a host collective that a peer does not is a deadlock or a silent mis-pairing; in the
interpreter it often passes by luck, so the sequences are compared explicitly.
"""

from __future__ import annotations

from ..errors import RankError

__all__ = ["ProtocolMismatch", "install_recorder", "compare_sequences"]

# torch.distributed entry points our code and tests call (patched per forked rank, so nothing leaks to the parent)
_COLLECTIVES = ("barrier", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce",
                "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce_scatter_tensor",
                "gather", "scatter", "reduce", "monitored_barrier")


class ProtocolMismatch(RankError):
    """The ranks of a world ran different sequences of collectives / signalling launches.

    Attributes:
        index: position of the first difference.
        sequences: every rank's recorded sequence (list by rank).
    """

    def __init__(self, message: str, index: int = -1, sequences=None):
        super().__init__(message)
        self.index = index
        self.sequences = sequences or []


def install_recorder(log: list):
    """In this (forked rank) process: append every recorded bound launch and torch.distributed collective to ``log``."""
    import torch.distributed as dist

    from ..runtime import recorder

    from torch.distributed import distributed_c10d as c10d

    recorder.set_recorder(log.append)
    depth = [0]  # a collective implemented with other collectives (all_gather_object) is recorded once
    for name in _COLLECTIVES:
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None or getattr(fn, "_tritonep_recorded", False):
            continue

        def wrapped(*args, __fn=fn, __name=name, **kwargs):
            if depth[0] == 0:
                log.append(("collective", __name))
            depth[0] += 1
            try:
                return __fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        wrapped._tritonep_recorded = True
        wrapped.__wrapped__ = fn
        # both entry points: torch.distributed.<name> and torch.distributed.distributed_c10d.<name>
        for mod in (dist, c10d):
            if getattr(mod, name, None) is fn:
                setattr(mod, name, wrapped)


def _fmt(seq, i, width=3):
    lo = max(0, i - width)
    rows = [f"    [{j}] {seq[j]}" for j in range(lo, min(len(seq), i + width + 1))]
    if i >= len(seq):
        rows.append(f"    [{i}] <end: {len(seq)} events>")
    return "\n".join(rows)


def compare_sequences(seqs: list, what: str = "world"):
    """Raise :class:`ProtocolMismatch` naming the first position where the ranks' sequences differ.

    Args:
        seqs: ``[sequence of rank 0, ...]``, each a list of event tuples.
    """
    if not seqs:
        return
    n = max(len(s) for s in seqs)
    for i in range(n):
        ev = [s[i] if i < len(s) else None for s in seqs]
        if any(e != ev[0] for e in ev):
            per_rank = "\n".join(f"  rank {r}:\n{_fmt(s, i)}" for r, s in enumerate(seqs))
            raise ProtocolMismatch(
                f"{what}: the ranks ran different host protocols (docs/protocols.md (host protocol rule)): event {i} is "
                + ", ".join(f"rank {r}: {e}" for r, e in enumerate(ev)) + f"\n{per_rank}",
                index=i, sequences=seqs)
