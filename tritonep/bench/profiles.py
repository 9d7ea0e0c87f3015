"""The benchmark shapes: ONE table every benchmark, probe and ``tritonep bench`` takes its sizes from.

A profile is ``hidden`` H, ``num_experts`` E, ``topk`` K and ``tokens`` per rank (0: a trace's tokens split over the
ranks), plus, where it matters, ``intermediate`` (the expert FFN width of MoE-layer benchmarks), a ``geometry``
(a ``TRITONEP_GEOMETRY`` string the profile pins) and a ``note`` for ``tritonep bench --help``. The shapes are the
models' own: DeepSeek-V3 (H 7168, 256 routed experts of width 2048, top-8), Qwen3-MoE (235B-A22B: H 4096, 128
experts of 1536, top-8); the packaged FLAME-MoE-290M trace gives routing only (64 experts, top-6), so ``real-trace``
takes H and the width of ``tritonep run``'s GPU defaults (2048, 1024).
"""

from __future__ import annotations

__all__ = ["PROFILES", "profile_shape", "DEFAULT_INTERMEDIATE"]

DEFAULT_INTERMEDIATE = 2048
"""Expert FFN width of a MoE-layer benchmark whose profile names none."""

PROFILES = {
    "deepseek-v3": dict(hidden=7168, num_experts=256, topk=8, tokens=4096, intermediate=2048),
    "decode": dict(hidden=7168, num_experts=256, topk=8, tokens=128, intermediate=2048,
                   note="the table picks the one-launch decode path (TRITONEP_GEOMETRY=dec=0: two kernels)"),
    # the decode shape with the one-launch decode dispatch / combine pinned (geometry dec=G; rows carry
    # exact_vs_two_kernel; no NCCL baselines)
    "decode-1launch": dict(hidden=7168, num_experts=256, topk=8, tokens=128, intermediate=2048,
                           geometry="bt=1,dec=128"),
    "deepseek-v3-1k": dict(hidden=7168, num_experts=256, topk=8, tokens=1024, intermediate=2048),
    "qwen3-moe": dict(hidden=4096, num_experts=128, topk=8, tokens=4096, intermediate=1536),
    # the packaged FLAME-MoE-290M router decisions (64 experts, top-6, 2048 tokens split over the ranks)
    "real-trace": dict(hidden=2048, num_experts=64, topk=6, tokens=0, trace_layer=2, intermediate=1024),
    # a CPU run of the benchmark code and its checks (interpreter; times mean nothing)
    "cpu-smoke": dict(hidden=128, num_experts=8, topk=2, tokens=6, intermediate=32,
                      note="checks only, without a GPU: tritonep bench dispatch --profile cpu-smoke (a CPU world)"),
}


def profile_shape(name: str = "deepseek-v3") -> tuple[int, int, int, int]:
    """``(hidden, num_experts, topk, tokens)`` of profile ``name``.

    Raises:
        KeyError: an unknown profile (the message lists the known ones).
    """
    if name not in PROFILES:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    p = PROFILES[name]
    return p["hidden"], p["num_experts"], p["topk"], p["tokens"]
