"""Bound launches of the nccl backend under calls that change everything a variant depends on.

One buffer per case, built under the fake GPU (``tests/backends/nccl/fake_gpu.py``: the second launch of a variant goes
direct, and the direct call must hand over the variant Triton's own binder picks for its arguments), then a script
of calls whose token counts change on every rank (0, 1, max; a rank without tokens), whose ``topk_idx`` alternates
int64 / int32, whose inputs start 2 elements into their storage (not 16-byte aligned) every other call,
``keep_quantized`` on and off, and one call with an expert id == E on one rank (refused on every rank, the buffer
usable after). Every call runs twice on the same buffer, kernels then torch twins, and both must give the same bits
(or the same error types); every kernel must have gone direct at least once on some rank.
"""

import pytest
import torch
import torch.distributed as dist

from tests.backends.nccl.fake_gpu import fake_gpu
from tests.backends.nccl.test_bound_launches import _calls, _compare
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of

_TMAX, _H, _E, _K = 12, 128, 12, 3
# per call: tokens per rank (cycled over the ranks), topk_idx dtype, inputs off 16-byte alignment, keep_quantized,
# the rank whose expert id is E (or None)
_SCRIPT = [((12, 0, 5), torch.int64, False, False, None), ((1, 12, 0), torch.int32, True, True, None),
           ((0, 0, 0), torch.int64, False, False, None), ((12, 12, 12), torch.int32, True, False, None),
           ((5, 3, 7), torch.int64, False, True, 1), ((3, 1, 12), torch.int64, True, False, None),
           ((12, 0, 5), torch.int32, False, False, None)]


def _off(t: torch.Tensor, shift: bool) -> torch.Tensor:
    """``t`` copied into a contiguous view that starts ``2`` elements into its storage (``shift``), else as is."""
    if not shift:
        return t
    v = torch.empty(t.numel() + 2, dtype=t.dtype)[2:].view(t.shape)
    return v.copy_(t)


def _world(group, wire, A):
    from tritonep import EPBuffer

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    quantized = wire != "bf16"
    with fake_gpu() as log:
        buf = EPBuffer(group, _E, _H, _TMAX, _K, expert_alignment=A, backend="nccl", device="cpu",
                       dispatch_wire=wire, combine_wire=wire if wire in ("fp8", "mxfp4") else "bf16")
        impl = backend_of(buf)
        for i, (Ts, idt, shift, kq, bad) in enumerate(_SCRIPT):
            T = Ts[rank % len(Ts)]
            x, idx, w = make_rank_inputs(rank, T, _H, _E, _K, seed=11 + i, mask_frac=0.2)
            if bad == rank and T:
                idx[T - 1, _K - 1] = _E
            x, idx, w = _off(x, shift), _off(idx.to(idt), shift), _off(w.float(), shift)
            assert T == 0 or (x.data_ptr() % 16 != 0) == shift
            gy = _off(torch.randn(T, _H, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16), shift)
            res = {}
            for ut in (True, False):
                impl.use_triton = ut
                try:
                    res[ut] = _calls(impl, x, idx, w, gy, kq and quantized)
                except Exception as e:  # noqa: BLE001 - compared below: both paths raise the same typed error
                    res[ut] = type(e).__name__
            if bad is not None:
                want = "InputError" if bad == rank else "PeerInputError"
                assert res[True] == res[False] == want, (i, rank, res)
            else:
                assert isinstance(res[True], dict), (i, rank, res[True])
                _compare(res[True], res[False], f"call {i} rank {rank}")
        buf.close()
    return log


@pytest.mark.parametrize("W,wire,A", [(3, "bf16", 1), (2, "fp8", 4), (3, "mxfp4", 16), (2, "fp8_e5m2", 1)])
def test_changing_calls_launch_the_right_variant_and_match_twins(W, wire, A):
    """The script above at W ranks: the kernels' outputs (bf16 / quantized dispatch, kept rows, combine, both
    backwards) equal the twins' bits on every call and rank, refused calls raise the same error on both paths, and
    every kernel also went direct on some rank (a direct launch checks its variant: ``fake_gpu``)."""
    logs = run_cpu_world(W, _world, wire, A, timeout_s=120)
    stale = [(rank, n) for rank, log in enumerate(logs) for k, n in log if k == "stale"]
    assert not stale, stale
    ran = {n for log in logs for _, n in log}
    direct = {n for log in logs for k, n in log if k == "direct"}
    assert ran == direct, ran - direct  # some rank launched each kernel directly at least once
    assert {"route_count_kernel", "route_pack_kernel", "route_unpack_kernel"} <= ran, ran
