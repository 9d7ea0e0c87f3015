"""Minimal mode says what it could not move: on an 8-rank, 8-expert routing file it moves 12 of the 20 routes of
total excess and leaves ranks at 54 against a capacity of 50 (balancedness 0.926);
:func:`tritonep.balance.plan_shortfall`, ``tritonep plan``'s output and its JSON name the unmoved routes, the ranks
that keep them and the full slots of the ranks that could have taken them. The plan's table keeps every list inside
its cell (one column per mode), so no line wraps mid-list."""

import json

import torch

from tritonep.balance import excess_routes, moved_routes, place_torch, plan_shortfall
from tritonep.cli.main import main as cli_main

# expert e's routes (one expert per rank: W = E = 8, so L = 1 virtual slot per rank); 400 routes, capacity 50
LOADS = [54, 54, 54, 54, 54, 42, 44, 44]


def write_issue_csv(path):
    """A top-1 CSV trace whose layer 0 gives expert ``e`` ``LOADS[e]`` tokens, 50 tokens per rank over 8 ranks."""
    ids = [e for e, n in enumerate(LOADS) for _ in range(n)]
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0)).tolist()
    rows = ["layer,token,e0,s0"] + [f"0,{t},{ids[i]},0.9" for t, i in enumerate(perm)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_shortfall_of_a_minimal_plan_out_of_slots():
    counts = torch.tensor(LOADS).view(1, 8).repeat(8, 1) // 8  # any split over sources: the totals decide
    counts[0] += torch.tensor(LOADS) - counts.sum(0)
    pl = place_torch(counts, "minimal")
    assert (moved_routes(pl), excess_routes(counts, 8)) == (12, 20)
    sf = plan_shortfall(pl)
    assert sf["unmoved_routes"] == 8 and sf["slots_per_rank"] == 1
    assert sf["over_capacity"] == [dict(rank=3, load=54, capacity=50), dict(rank=4, load=54, capacity=50)]
    assert [u["rank"] for u in sf["under_capacity"]] == [5, 6, 7]
    assert all(u["slots_used"] == 1 and u["load"] < 50 for u in sf["under_capacity"])
    ref = plan_shortfall(place_torch(counts, "reference"))  # the reference always balances exactly
    assert ref["unmoved_routes"] == 0 and ref["over_capacity"] == ref["under_capacity"] == []


def test_plan_minimal_reports_what_it_could_not_move(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    csv = write_issue_csv(tmp_path / "skew.csv")
    out_json = tmp_path / "plan.json"
    rc = cli_main(["plan", "--routing", csv, "--world-size", "8", "--mode", "minimal", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    text = " ".join(out.split())
    assert "minimal mode: balancedness 0.926, moved routes 12 (total excess 20), max load 54 (capacity 50)" in text
    assert ("minimal mode could not move 8 of the 20 routes of total excess: rank 3 at 54 (capacity 50), rank 4 at "
            "54 (capacity 50) stay over capacity, because every rank under capacity (rank 5 at 46, rank 6 at 48, "
            "rank 7 at 48) has its only virtual slot in use") in text, out
    res = json.loads(out_json.read_text())
    assert res["moved_routes"] == 12 and res["excess_routes"] == 20 and res["unmoved_routes"] == 8
    assert res["shortfall"]["over_capacity"][0] == dict(rank=3, load=54, capacity=50)
    assert res["modes"]["minimal"]["unmoved_routes"] == 8
    assert res["modes"]["minimal"]["shortfall"]["under_capacity"][0] == dict(rank=5, load=46, capacity=50,
                                                                               slots_used=1)


def test_plan_both_modes_side_by_side_lists_in_their_cells(tmp_path, capsys, monkeypatch):
    """Default plan (OLMoE layer 0, 8 ranks, both modes): each rank's virtual experts of each mode sit in that rank's
    row (the old summary line listed every rank's experts in one line that wrapped mid-list); a plan that balances
    has no shortfall note."""
    monkeypatch.setenv("COLUMNS", "200")
    out_json = tmp_path / "plan.json"
    assert cli_main(["plan", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].isdigit():
            rows[int(cells[0])] = cells
    assert sorted(rows) == list(range(8)), out
    for m, col in (("reference", 4), ("minimal", 6)):
        for d, cells in rows.items():
            want = " ".join(str(e) for e in res["modes"][m]["experts_to_copy"][d] if e >= 0) or "-"
            assert cells[col] == want and cells[col - 1] == str(res["modes"][m]["after"][d]), (m, d, cells)
        assert res["modes"][m]["unmoved_routes"] == 0
    assert "could not move" not in out and all(len(ln) <= 200 for ln in out.splitlines())
