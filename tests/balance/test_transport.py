"""Virtual-expert weight push / gradient pull over the CPU symmetric heap, checked against the placement."""

import pytest
import torch
import torch.distributed as dist

from tritonep.balance import place_torch
from tritonep.balance.transport import PushWeights
from tritonep.backends.triton.expert_transport import ExpertTransport
from tritonep.testing import run_cpu_world

H, I2 = 8, 6  # per-expert weight shape of the test


def _native(rank, L, step):
    e = torch.arange(rank * L, rank * L + L, dtype=torch.float32)
    return (e[:, None, None] * 10 + step + torch.arange(H * I2).view(1, H, I2) / 64).to(torch.bfloat16)


def _counts(step, W, E):
    g = torch.Generator().manual_seed(step)
    hot = torch.randint(0, E, (1,), generator=g).item()
    c = torch.randint(0, 20, (W, E), generator=g)
    c[:, hot] += 60 * (step % 3 + 1)  # a moving hot expert
    c[step % W] += 5  # a hot source rank
    return c


def _make_transport(backend, group, E, shapes, dtype, dev, timeout_s=None):
    from tritonep.backends.nccl.expert_transport import NcclExpertTransport

    cls = ExpertTransport if backend == "triton" else NcclExpertTransport
    return cls(group, E, shapes, dtype=dtype, device=dev, timeout_s=timeout_s)


def _transport_world(group, steps, E, backend="triton"):
    rank, W = dist.get_rank(), dist.get_world_size()
    L = E // W
    tr = _make_transport(backend, group, E, {"w1": (H, I2)}, torch.bfloat16, "cpu")
    bad = []
    for step in range(steps):
        pl = place_torch(_counts(step, W, E))
        w = _native(rank, L, step).requires_grad_(True)
        (slots,) = PushWeights.apply(tr, pl, ("w1",), w)
        etc = pl.experts_to_copy[rank]
        for s in range(L):  # every used slot holds exactly the planned expert's current weights
            e = int(etc[s])
            if e >= 0:
                owner, j = divmod(e, L)
                if not torch.equal(slots[s], _native(owner, L, step)[j]):
                    bad.append((step, s, e))
        # slot gradient: slot s on this rank contributes (rank + 1) * (s + 1)
        gs = torch.stack([torch.full((H, I2), float((rank + 1) * (s + 1))) for s in range(L)]).to(torch.bfloat16)
        (slots.float() * gs.float()).sum().backward()
        want = torch.zeros(L, H, I2)
        for j in range(L):
            e = rank * L + j
            for d in range(W):
                s = int(pl.expert_slot[e, d])
                if s >= 0 and d != rank:
                    want[j] += (d + 1) * (s + 1)
        if not torch.equal(w.grad.float(), want):
            bad.append((step, "grad"))
    tr.check()
    tr.close()
    return bad


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_push_pull_20_steps_of_changing_skew(backend):
    res = run_cpu_world(4, _transport_world, 20, 16, backend, timeout_s=300)
    assert res == [[], [], [], []], res


# ------------------------------------------------------------------------------------------------ in-place pull_add
def _skew_counts(kind, W, E):
    """``[W, E]`` route counts: ``hot0`` (rank 0's experts hot: rank 0 uses no slot, the others hold only rank 0's
    experts and none of theirs is held), ``even`` (nothing moves), ``rand`` (random with a hot expert)."""
    L = E // W
    if kind == "hot0":
        c = torch.zeros(W, E, dtype=torch.int64)
        c[:, :L] = 40
        return c
    if kind == "even":
        return torch.full((W, E), 3, dtype=torch.int64)
    return _counts(7, W, E)


SHAPES = {"w1": (H, I2), "w2": (I2, H)}


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _grads(name, rows, dtype, seed):
    """Deterministic gradients spanning many binades (plus bf16 subnormals) so every rounding step matters."""
    g = torch.Generator().manual_seed(seed)
    shp = (rows, *SHAPES[name])
    v = torch.randn(shp, generator=g) * torch.exp2(torch.randint(-20, 8, shp, generator=g).float())
    v[..., 0] = 3e-39  # subnormal in bf16 and fp32
    return v.to(dtype)


def _pull_add_world(group, kinds, dtype, on_gpu=False, backend="triton"):
    """Rank body: pull into the native gradient (given / None) and pull for each plan kind, checked bit for bit against
    the torch twins computed on the host from every rank's slot gradients; returns the list of failures."""
    from tritonep.balance.transport import used_slot_count
    from tritonep.backends.slot_transport import pull_torch

    rank, W = dist.get_rank(), dist.get_world_size()
    E = 4 * W
    L = E // W
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    tr = _make_transport(backend, group, E, SHAPES, dtype, dev, timeout_s=60)
    bad = []
    for step, kind in enumerate(kinds):
        pl = place_torch(_skew_counts(kind, W, E))
        used = [used_slot_count(pl.experts_to_copy[d].tolist()) for d in range(W)]
        lo = rank * L
        held = [j for j in range(L) if bool((pl.expert_slot[lo + j] >= 0).any())]
        slot_all = {k: [_grads(k, used[d], dtype, 1000 * step + 10 * d + i) for d in range(W)]
                    for i, k in enumerate(("w1", "w2"))}
        for native_none in (False, True):
            natives = {k: None if native_none else _grads(k, L, dtype, 777 + 1000 * step + 10 * rank + i).to(dev)
                       for i, k in enumerate(("w1", "w2"))}
            before = {k: None if v is None else v.to("cpu", copy=True) for k, v in natives.items()}
            out = tr.pull({k: v[rank].to(dev) for k, v in slot_all.items()}, pl, used[rank], held, into=dict(natives))
            for k in ("w1", "w2"):
                want = pull_torch(slot_all[k], pl, rank, into=before[k])
                if natives[k] is not None and out[k].data_ptr() != natives[k].data_ptr():
                    bad.append((kind, k, "not in place"))
                got = None if out[k] is None else out[k].cpu()
                if (want is None) != (got is None) or (got is not None and not torch.equal(_bits(got), _bits(want))):
                    bad.append((kind, native_none, k, "bits"))
                for j in range(L):  # experts nobody held: untouched
                    if j not in held and got is not None and before[k] is not None and not torch.equal(got[j],
                                                                                                      before[k][j]):
                        bad.append((kind, k, j, "touched"))
        # the dense pull accumulates into zeros
        full = {k: torch.cat([slot_all[k][rank], torch.zeros(L - used[rank], *slot_all[k][rank].shape[1:],
                                                               dtype=dtype)]) for k in ("w1", "w2")}
        dense = tr.pull({k: v.to(dev) for k, v in full.items()}, pl)
        for k in ("w1", "w2"):
            if not torch.equal(_bits(dense[k].cpu()), _bits(pull_torch(slot_all[k], pl, rank, shape=SHAPES[k], dtype=dtype))):
                bad.append((kind, k, "pull"))
        if kind == "hot0":
            assert used[0] == 0 and all(u > 0 for u in used[1:]) and bool(held) == (rank == 0)
    tr.check()
    tr.close()
    return bad


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_pull_add_in_place_bit_exact_vs_twin(backend):
    """pull(into=...) == pull_torch bit for bit (bf16 and fp32), in place, experts nobody held untouched, None
    kept where nothing is held; ranks that hold nothing or use no slot launch the same kernels / collectives
    (protocol check); on both backends."""
    for W, dtype in ((2, torch.bfloat16), (4, torch.bfloat16), (2, torch.float32)):
        res = run_cpu_world(W, _pull_add_world, ["hot0", "rand", "even"], dtype, False, backend, timeout_s=300)
        assert res == [[]] * W, (W, dtype, res)


@pytest.mark.gpu
def test_gpu_pull_add_bit_exact_vs_twin(gpu_world, gpu_world_size):
    """The same on a GPU world: the kernel's rounding (cast_rne / widen) gives the twin's bits on the device too."""
    W = gpu_world_size
    for dtype in (torch.bfloat16, torch.float32):
        res = gpu_world(W, _pull_add_world, ["hot0", "rand", "even"], dtype, True, timeout_s=300)
        assert res == [[]] * W, (dtype, res)


def test_pull_add_torch_is_torchs_accumulation():
    """The twin's bits are those of the previous host code: ``grad[j].add_(DT(fp32 sum over holders))``."""
    from tritonep.balance.transport import used_slot_count
    from tritonep.backends.slot_transport import pull_torch

    W, E = 4, 16
    pl = place_torch(_counts(3, W, E))
    used = [used_slot_count(pl.experts_to_copy[d].tolist()) for d in range(W)]
    for dtype in (torch.bfloat16, torch.float32):
        slots = [_grads("w1", used[d], dtype, d) for d in range(W)]
        for rank in range(W):
            g = _grads("w1", E // W, dtype, 50 + rank)
            want = g.clone()
            for j in range(E // W):
                e = rank * (E // W) + j
                acc = torch.zeros(H, I2)
                hold = [(d, int(pl.expert_slot[e, d])) for d in range(W) if d != rank and pl.expert_slot[e, d] >= 0]
                for d, s in hold:
                    acc += slots[d][s].float()
                if hold:
                    want[j].add_(acc.to(dtype))
            assert torch.equal(_bits(pull_torch(slots, pl, rank, into=g)), _bits(want))


def _pull_noncontig_world(group, backend):
    """pull(into=) with a non-contiguous native gradient: the sums land IN that tensor (the documented in-place
    contract), bit-equal to the twin; returns the failures."""
    from tritonep.balance.transport import used_slot_count
    from tritonep.backends.slot_transport import pull_torch

    rank, W = dist.get_rank(), dist.get_world_size()
    E, dtype = 4 * W, torch.bfloat16
    L = E // W
    tr = _make_transport(backend, group, E, SHAPES, dtype, torch.device("cpu"), timeout_s=60)
    pl = place_torch(_skew_counts("hot0", W, E))
    used = [used_slot_count(pl.experts_to_copy[d].tolist()) for d in range(W)]
    held = [j for j in range(L) if bool((pl.expert_slot[rank * L + j] >= 0).any())]
    slot_all = {k: [_grads(k, used[d], dtype, 10 * d + i) for d in range(W)] for i, k in enumerate(("w1", "w2"))}
    into = {k: _grads(k, L, dtype, 50 + rank + i).transpose(1, 2).contiguous().transpose(1, 2)
            for i, k in enumerate(("w1", "w2"))}  # [L, *shape] values, non-contiguous strides
    before = {k: v.clone() for k, v in into.items()}
    out = tr.pull({k: v[rank] for k, v in slot_all.items()}, pl, used[rank], held, into=dict(into))
    bad = []
    for k in ("w1", "w2"):
        assert not before[k].is_contiguous() or not into[k].is_contiguous()
        want = pull_torch(slot_all[k], pl, rank, into=before[k])
        if not torch.equal(_bits(out[k].contiguous()), _bits(want)):
            bad.append((k, "returned bits"))
        if not torch.equal(_bits(into[k].contiguous()), _bits(want)):
            bad.append((k, "into not updated in place"))
    tr.close()
    return bad


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_pull_into_non_contiguous_is_in_place(backend):
    res = run_cpu_world(2, _pull_noncontig_world, backend, timeout_s=300)
    assert res == [[], []], res
