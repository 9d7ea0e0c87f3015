"""The output pool (:mod:`tritonep.runtime.pool`) across autograd modes: a set outlives the call that made it, so the mode
of that call must not reach a later call (the first two matter with the pool on only).

* A set made inside ``torch.inference_mode()`` (a rollout / eval that keeps one call's outputs while it makes the
  next) held inference tensors; a later call in grad mode got them: ``expert_offsets`` could not be saved for the
  grouped GEMM's backward, the decode rows and the combine output took no in-place op. Sets are now made of normal
  tensors whatever the mode.
* A forward-mode tangent a caller's in-place op put on a pooled base (``d.x.mul_(dual)`` / ``d.weights.mul_(dual)``
  inside ``forward_ad.dual_level()``) came back on the next call's outputs (a wrong JVP, silently); such a set is now
  dropped like one with a reverse-mode mark.
* A buffer's persistent tensors made inside inference mode (the buffer built there, or the nccl backend's sync-free
  send / receive rows made by its first sync-free call there) could not be updated in place by later grad-mode calls
  ("Inplace update to inference tensor outside InferenceMode"); they are now made as normal tensors.

Triton backend (two kernels, the one-launch decode geometry) and the nccl backend's sync-free pool in both modes, CPU
world of 1.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from tritonep.testing import run_cpu_world
from tests.support.harness import expert, make_calls, open_buffer, set_env

CFG = dict(E=8, H=64, Tmax=8, K=2, A=1)
CASES = [("triton", "", False), ("triton", "bt=2,dec=3", False), ("nccl", "onehop", True), ("nccl", "gather", True)]
IDS = ["two-kernel", "decode", "nccl-onehop", "nccl-gather"]


def _env(backend, mode):
    """The case's environment: the triton geometry, or the nccl backend's sync-free mode."""
    if backend == "nccl":
        set_env(TRITONEP_GEOMETRY=None, TRITONEP_NCCL_SYNC_FREE=mode)
    else:
        set_env(TRITONEP_GEOMETRY=mode or None)


def _outputs(d, y):
    return dict(x=d.x, ntpe=d.num_tokens_per_expert, offs=d.expert_offsets, weights=d.weights, y=y)


def _inference_world(group, backend, geometry, sync_free, built_inside, calls):
    _env(backend, geometry)
    set_env(TRITONEP_OUTPUT_POOL="3")
    if built_inside:  # a buffer built inside inference mode (its persistent tensors too)
        with torch.inference_mode():
            buf = open_buffer(group, dict(CFG, backend=backend))
    else:
        buf = open_buffer(group, dict(CFG, backend=backend))
    c0, c1 = calls[0]
    with torch.inference_mode():  # keeps one call's outputs while it makes the next: the pool makes sets now
        kept = []
        for c in (c0, c1, c0):
            d = buf.dispatch(*c, sync_free=sync_free)
            kept.append((d, buf.combine(expert(d.x), d.handle)))
        del kept, d
    got = []
    kept = []
    for _ in range(3):  # grad mode again, each call kept while the next is made: every set is reached
        d = buf.dispatch(*c0, sync_free=sync_free)
        y = buf.combine(expert(d.x), d.handle)
        inf = sorted(k for k, t in _outputs(d, y).items() if t is not None and t.is_inference())
        d.x.mul_(1)  # README: the rows take in-place ops
        y.add_(0)
        a = d.x.detach().clone().requires_grad_(True)
        w = torch.randn(buf.num_local_experts, CFG["H"], 32, dtype=torch.bfloat16, requires_grad=True)
        torch._grouped_mm(a, w, offs=d.expert_offsets).float().sum().backward()  # saves offs for backward
        got.append(inf)
        kept.append((d, y))
    buf.close()
    return got


@pytest.mark.parametrize("built_inside", [False, True], ids=["built-outside", "built-inside"])
@pytest.mark.parametrize("backend,geometry,sync_free", CASES, ids=IDS)
def test_sets_made_in_inference_mode_serve_grad_mode_calls(backend, geometry, sync_free, built_inside):
    calls = make_calls(1, CFG, [7], [21, 22], mask_frac=0.2)
    (got,) = run_cpu_world(1, _inference_world, backend, geometry, sync_free, built_inside, calls, timeout_s=300)
    assert got == [[], [], []], f"grad-mode calls got inference tensors: {got}"


def _tangent_world(group, backend, geometry, sync_free, calls):
    _env(backend, geometry)
    set_env(TRITONEP_OUTPUT_POOL="1")  # one set: the next call reuses it
    buf = open_buffer(group, dict(CFG, backend=backend))
    c0, c1 = calls[0]
    out = []
    with fwAD.dual_level():
        for name in ("x", "weights"):
            d = buf.dispatch(*c0, sync_free=sync_free)
            t = getattr(d, name)
            dual = fwAD.make_dual(torch.ones_like(t), torch.full_like(t, 3.0))
            t.mul_(dual)  # the caller's in-place op with a dual operand on its own output
            del d, t, dual
            d = buf.dispatch(*c1, sync_free=sync_free)
            out.append(sorted(k for k, v in _outputs(d, None).items()
                              if v is not None and fwAD.unpack_dual(v).tangent is not None))
            del d
    buf.close()
    return out


@pytest.mark.parametrize("backend,geometry,sync_free", CASES, ids=IDS)
def test_forward_ad_tangent_does_not_reach_the_next_call(backend, geometry, sync_free):
    calls = make_calls(1, CFG, [7], [21, 22], mask_frac=0.2)
    (got,) = run_cpu_world(1, _tangent_world, backend, geometry, sync_free, calls, timeout_s=300)
    assert got == [[], []], f"the next call's outputs carried the earlier call's tangent: {got}"


def _gpu_modes(group, T):
    """The two scenarios above on the GPU (the pool's sets per CUDA stream): a buffer built inside inference mode,
    calls inside it that keep outputs (sets made there), then grad-mode calls (in-place ops, grouped-GEMM backward
    with ``offs=expert_offsets``) and a dual-level call whose in-place op puts a tangent on the pooled rows."""
    import tritonep as tep

    dev = torch.device("cuda", torch.cuda.current_device())
    H, E, K = 256, 16, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].contiguous().to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    with torch.inference_mode():
        buf = tep.EPBuffer(group, E, H, T, K)
        kept = [buf.dispatch(x, idx, w) for _ in range(3)]
        del kept
    inf, kept = [], []
    for _ in range(3):
        d = buf.dispatch(x, idx, w)
        y = buf.combine(buf.expert_out_buffer(d.x.shape[0]), d.handle)
        inf += [k for k, t in _outputs(d, y).items() if t is not None and t.is_inference()]
        d.x.mul_(1)
        a = d.x.detach().clone().requires_grad_(True)
        wt = torch.randn(buf.num_local_experts, H, 32, dtype=torch.bfloat16, device=dev, requires_grad=True)
        torch._grouped_mm(a, wt, offs=d.expert_offsets).float().sum().backward()
        kept.append((d, y))
    del kept, d, y
    tangents = []
    with fwAD.dual_level():
        d = buf.dispatch(x, idx, w)
        t = d.x
        t.mul_(fwAD.make_dual(torch.ones_like(t), torch.full_like(t, 3.0)))
        del d, t
        for _ in range(3):
            d = buf.dispatch(x, idx, w)
            tangents += [k for k, v in _outputs(d, None).items()
                         if v is not None and fwAD.unpack_dual(v).tangent is not None]
            del d
    torch.cuda.synchronize()
    buf.close()
    return dict(inference=inf, tangents=tangents)


@pytest.mark.world1
@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 1024])
def test_gpu_pool_modes(gpu_world, T):
    """One GPU, the decode (128) and fused (1024) geometries: no inference tensor and no stale tangent reaches a
    later call through the pool."""
    (res,) = gpu_world(1, _gpu_modes, T)
    assert res == dict(inference=[], tangents=[]), res
