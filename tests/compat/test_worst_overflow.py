"""A compat ``dispatch(num_worst_tokens=N)`` whose ranks receive more than N rows.

docs/deep_ep.md ("Capacity", "Errors"): such a call reads nothing on the host, so it cannot raise; it is refused on
every rank (no row moves), its outputs are NaN so they cannot pass for a result (rows, weights, the combine's output
and combined weights; ids -1), and every rank raises CapacityError at its next synced dispatch (which runs on
another inner EPBuffer than the worst-mode call: the Buffer reads the lanes nobody read) or at ``Buffer.check()``,
once. Caller-quantized rows come back as NaN bytes too. A worst-mode call that fits, and synced calls after the
refusal, give the right rows (every token reaches two ranks: the combine is 2x).
"""

import pytest
import torch

from tritonep.compat import deep_ep as compat
from tritonep.errors import CapacityError
from tritonep.testing import run_cpu_world

# every wait's bound in these worlds: no test here expects a timeout; on a GPU the ranks' first launches of the
# compat's own kernels compile (seconds) while a peer may already wait
_WAIT_S = 60 if torch.cuda.is_available() else 20


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _call(buf, E, worst, quantized=False):
    dev = _device()
    x = torch.randn(4, 128, device=dev).bfloat16() + 1
    idx = torch.tensor([[0, 2], [1, 3], [0, 3], [1, 2]], device=dev) % E  # every token to two ranks (W = 2, 3)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx,
                topk_weights=torch.ones(4, 2, device=dev), num_worst_tokens=worst)
    try:
        if quantized:  # fp8 bytes and float32 scales: refused rows come back as all-ones bytes (NaN in both)
            xq = torch.randint(0, 120, (4, 128), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
            (rq, rs), *_ = buf.dispatch((xq, torch.ones(4, 2, device=dev)), **args)
            return "nan" if bool((rq.view(torch.uint8) == 255).all()) and bool(rs.isnan().all()) else "rows"
        rx, ri, rw, counts, h, _ = buf.dispatch(x, **args)
        y, w, _ = buf.combine(rx, h, topk_weights=rw)
    except CapacityError:
        return "CapacityError"
    if worst and rx.shape[0] != worst:
        return "wrong shape"
    nan = [t.numel() > 0 and bool(t.float().isnan().all()) for t in (rx, rw, y, w)]  # a rank may receive none
    if all(nan) and bool((ri == -1).all()):  # (CPU worlds and GPU ones: tests/compat/test_gpu.py)
        return "nan"
    if not any(nan) and torch.equal(y.float(), 2 * x.float()):
        return "rows"
    return f"wrong {nan}"


def _check(buf):
    try:
        buf.check()
        return "ok"
    except CapacityError:
        return "CapacityError"


def _world(group, backend, meta_rows_max_tokens=256):
    """Every rank's outcomes of the sequence below (device: the current CUDA device, else the CPU);
    ``meta_rows_max_tokens``: the Buffer's (0: the top-k in the meta lane; else as meta rows of the rows lane)."""
    W = group.size()
    E = 2 * W
    buf = compat.Buffer(group, 0, 0, backend=backend, timeout_s=_WAIT_S, meta_rows_max_tokens=meta_rows_max_tokens)
    out = [_call(buf, E, 6),     # 4W rows to ranks 0 and 1 > 6: refused, NaN, nothing raised (no host read)
           _call(buf, E, 0),     # a synced dispatch (another lane): raises the refusal on every rank, before moving
           _call(buf, E, 6),     # again: refused, NaN
           _call(buf, E, 6, quantized=True),
           _check(buf), _check(buf),  # the refusals recorded: raised once
           _call(buf, E, 64), _check(buf),  # fits: rows, nothing recorded
           _call(buf, E, 0)]     # the Buffer stays usable
    buf.destroy()
    return out


EXPECT = ["nan", "CapacityError", "nan", "nan", "CapacityError", "ok", "rows", "ok", "rows"]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("meta_rows_max_tokens", [256, 0])
def test_worst_tokens_overflow_is_nan_and_raised(backend, W, meta_rows_max_tokens):
    for r, out in enumerate(run_cpu_world(W, _world, backend, meta_rows_max_tokens, timeout_s=120)):
        assert out == EXPECT, (r, out)


def _decode_world(group):
    """:func:`_world` on the one-launch decode tiles, whose rows lane carries the top-k with its rows (no meta row
    travels): its receive room is ``num_worst_tokens`` rows exactly, so a call over it by fewer rows than the meta
    rows' room is refused too (ids -1, raised at the next read)."""
    import os

    os.environ["TRITONEP_GEOMETRY"] = "bt=2,dec=3"
    return _world(group, "triton")


def test_worst_tokens_overflow_carried():
    for r, out in enumerate(run_cpu_world(2, _decode_world, timeout_s=120)):
        assert out == EXPECT, (r, out)
