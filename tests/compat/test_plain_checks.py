"""The one-expression checks of a combine's common call (``_plain_rows``, ``_plain_weights``) accept only what the
checks one by one (``NormalChecks._combine_checked``) accept: an input they pass skips every other check, so one
they let through that the full checks refuse would be a silent wrong answer. Tried over rows and weights of the
wrong dtype, shape, rank, device (``meta``), strides, with ``requires_grad``, as a Parameter, a list, and top-k
widths K and 0."""

import itertools
import types

import torch

from tritonep.compat.deep_ep.normal_checks import NormalChecks, _plain_rows, _plain_weights
from tritonep.errors import TritonEPError

R, H, K = 6, 16, 3


class _Checks(NormalChecks):
    W = 2

    def _cancel_combine(self, *args, **kwargs):  # a refused call takes part in nothing here
        pass


def _full_ok(x, h, w) -> bool:
    try:
        _Checks()._combine_checked(x, h, w, None, None, True)
        return True
    except TritonEPError:
        return False


def test_plain_checks_accept_nothing_the_full_checks_refuse():
    base = torch.rand(R, K)
    ws = [None, base, base.double(), base.bfloat16(), base.half(), base.long(), base[:, :K - 1], torch.rand(R + 1, K),
          torch.rand(R, K + 1), base.T.contiguous().T, base.reshape(-1), base.unsqueeze(0),
          torch.rand(R, K, requires_grad=True), torch.nn.Parameter(base.clone()), torch.empty(R, 0),
          torch.rand(0, K), base.to("meta"), [[1.0] * K] * R]
    xs = [torch.rand(R, H).bfloat16(), torch.rand(R, H), torch.rand(R, H + 1).bfloat16(),
          torch.rand(R + 1, H).bfloat16(), torch.rand(H, R).bfloat16().T, torch.rand(R, H).bfloat16().to("meta"),
          torch.rand(1, R, H).bfloat16(), [[0.0] * H] * R]
    lane = types.SimpleNamespace(device=torch.device("cpu"), hidden=H)
    fast = 0
    for topk in (K, 0):
        h = types.SimpleNamespace(num_rows=R, topk=topk, x_lane=lane, num_tokens=4)
        for x, w in itertools.product(xs, ws):
            if _plain_rows(x, h) and (w is None or _plain_weights(w, h)):
                fast += 1
                assert _full_ok(x, h, w), (topk, x, w)
    assert fast >= 10  # the common calls do take the one-expression checks
