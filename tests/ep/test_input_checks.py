"""EPBuffer.dispatch_backward / combine_backward (the backward halves the MoE layer chains outside autograd) check
their inputs like combine does: a typed error naming the value before any launch, never a kernel reading a
tensor of the wrong dtype or width. Every rank passes the same bad input here, so no rank waits for another."""

import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs

BF16 = torch.bfloat16


def _bad_backward_world(group, backend):
    rank = dist.get_rank(group)
    E, H, Tm, K = 4, 64, 8, 2
    buf = tep.EPBuffer(group, E, H, Tm, K, backend=backend)
    other = tep.EPBuffer(group, E, H, Tm, K, backend=backend)
    x, idx, w = make_rank_inputs(rank, 6, H, E, K, seed=3)
    d = buf.dispatch(x, idx, w)
    R = d.x.shape[0]
    eo = d.x.clone()
    gy = torch.ones(6, H, dtype=BF16)
    cases = {
        "combine_backward grad_y float32": lambda: buf.combine_backward(gy.float(), eo, d.handle),
        "combine_backward grad_y narrow": lambda: buf.combine_backward(gy[:, :32], eo, d.handle),
        "combine_backward grad_y rows": lambda: buf.combine_backward(gy[:5], eo, d.handle),
        "combine_backward expert_out float32": lambda: buf.combine_backward(gy, eo.float(), d.handle),
        "combine_backward foreign handle": lambda: other.combine_backward(gy, eo, d.handle),
        "dispatch_backward grad_x float32": lambda: buf.dispatch_backward(eo.float(), None, d.handle),
        "dispatch_backward grad_x narrow": lambda: buf.dispatch_backward(eo[:, :32], None, d.handle),
        "dispatch_backward grad_w float16": lambda: buf.dispatch_backward(eo, torch.ones(R, dtype=torch.float16),
                                                                          d.handle),
        "dispatch_backward grad_w short": lambda: buf.dispatch_backward(eo, torch.ones(max(R - 1, 0)), d.handle)
        if R else buf.dispatch_backward(eo, torch.ones(1, 1), d.handle),
        "dispatch_backward foreign handle": lambda: other.dispatch_backward(eo, None, d.handle),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "accepted"
        except (tep.InputError, tep.ConfigError) as e:
            out[name] = type(e).__name__
    # the good calls still work afterwards (no launch was made by a refused call)
    g_eo, g_w = buf.combine_backward(gy, eo, d.handle)
    g_x, g_tw = buf.dispatch_backward(g_eo, g_w, d.handle)
    out["good"] = (tuple(g_x.shape), tuple(g_tw.shape))
    other.close()
    buf.close()
    return out


def test_backward_halves_refuse_bad_inputs():
    for backend in ("triton", "nccl"):
        res = run_cpu_world(2, _bad_backward_world, backend, timeout_s=300)
        for r, out in enumerate(res):
            assert out.pop("good") == ((6, 64), (6, 2))
            accepted = [k for k, v in out.items() if v == "accepted"]
            assert not accepted, (backend, r, accepted)
            assert all(v == "ConfigError" for k, v in out.items() if "foreign" in k), out
