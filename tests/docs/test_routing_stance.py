"""What the API does with routing a router would never produce, as docs/guarantees.md ("Routing values") states it,
and how the routing-file parser differs on purpose.

The API checks shapes, dtypes and id ranges, not values it would need a host read for: an expert id twice in one
row is two routes (two received rows, each weighted by its own weight, so the token gets the sum of both weights
times that expert's output); a NaN weight makes that token's combine output NaN and no other token's; a masked slot
(-1) never reads its weight, NaN included. A routing file is data written by a tool, not a router's live output: the
parser refuses an id twice in a row and a non-finite score, naming the line and column."""

import pytest
import torch

from tritonep.data.routing_file import load_routing_csv
from tritonep.errors import DataError
from tritonep.testing import run_cpu_world

NAN = float("nan")


def _rank(group, backend):
    import tritonep as tep

    torch.manual_seed(group.rank())
    buf = tep.EPBuffer(group, num_experts=4, hidden=64, max_tokens_per_rank=4, topk=2, backend=backend)
    x = torch.randn(4, 64).bfloat16()
    idx = torch.tensor([[1, 1], [0, 3], [2, -1], [3, 0]])  # token 0: expert 1 twice; token 2: a masked slot
    w = torch.tensor([[0.25, 0.5], [NAN, 0.5], [1.0, NAN], [0.5, 0.5]])  # token 1: NaN; token 2: NaN on the -1 slot
    out = buf.dispatch(x, idx, w)
    counts = out.num_tokens_per_expert.tolist()
    y = buf.combine(out.x * 2, out.handle)  # experts that double their rows
    buf.close()
    return x, y, counts


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_duplicate_ids_are_two_routes_and_nan_weights_stay_in_their_token(backend):
    res = run_cpu_world(2, _rank, backend)
    routes = [0] * 4  # routes each expert receives over both ranks (the same routing on every rank)
    for e in (1, 1, 0, 3, 2, 3, 0):
        routes[e] += 2
    got = [c for _, _, cs in res for c in cs]
    assert got == routes, got  # expert 1 gets token 0 twice from each rank
    for x, y, _ in res:
        y, x = y.float(), x.float()
        assert torch.isnan(y).any(1).tolist() == [False, True, False, False]  # only token 1's row
        torch.testing.assert_close(y[0], 2 * 0.75 * x[0], rtol=2e-2, atol=2e-2)  # (0.25 + 0.5) x 2 x[0]
        torch.testing.assert_close(y[2], 2 * x[2], rtol=2e-2, atol=2e-2)  # the masked slot's NaN never read
        torch.testing.assert_close(y[3], 2 * x[3], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("row,col,what", [("0,0,5,5", 7, "expert 5 appears twice in the row"),
                                          ("0,0,5,2,nan,0.5", 9, "score nan is not a finite number")])
def test_routing_files_refuse_what_a_router_never_writes(tmp_path, row, col, what):
    path = tmp_path / "r.csv"
    head = "layer,token,e0,e1" + (",s0,s1" if row.count(",") > 3 else "")
    path.write_text(f"{head}\n{row}\n")
    with pytest.raises(DataError) as ei:
        load_routing_csv(str(path))
    assert str(ei.value).startswith(f"{path}:2:{col}:") and what in str(ei.value), str(ei.value)
