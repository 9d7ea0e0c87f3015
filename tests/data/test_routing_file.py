"""Routing files of a user's own router (tritonep.data.routing_file): CSV traces and JSON histograms, and one test
per kind of bad file, each refused with ``FILE:LINE:COL: message``."""

import re
from importlib import resources

import pytest
import torch

from tritonep.data import load_flame_trace
from tritonep.data.routing_file import load_routing_file
from tritonep.data.routing_records import RoutingHistogram, RoutingTrace
from tritonep.errors import DataError

GOOD_CSV = "layer,token,e0,e1,s0,s1\n0,1,7,5,0.48,0.32\n0,0,5,2,0.6,0.2\n3,0,1,-1,0.9,0.0\n"


def _write(tmp_path, text, name="r.csv"):
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return str(p)


def test_packaged_trace_reads_the_same_as_its_loader():
    path = str(resources.files("tritonep.data").joinpath("prefill_2048tok_layers2-9_top6.csv"))
    tr = load_routing_file(path)
    assert isinstance(tr, RoutingTrace) and tr.topk == 6 and tr.has_scores and tr.max_expert == 63
    assert tr.layers() == list(range(2, 10))
    for layer in (2, 9):
        idx, w = tr.routing(layer, renormalize=False)
        ref_idx, ref_w = load_flame_trace(layer)
        assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
        torch.testing.assert_close(tr.routing(layer)[1], load_flame_trace(layer, renormalize=True)[1])


def test_csv_token_order_scores_and_masked_slots(tmp_path):
    tr = load_routing_file(_write(tmp_path, GOOD_CSV), num_experts=8)
    assert tr.layers() == [0, 3] and tr.topk == 2 and tr.max_expert == 7 and tr.num_tokens(0) == 2
    idx, w = tr.routing(0, renormalize=False)
    assert idx.tolist() == [[5, 2], [7, 5]]  # sorted by token (the arrival order), not file order
    assert torch.equal(w, torch.tensor([[0.6, 0.2], [0.48, 0.32]], dtype=torch.float32))
    idx, w = tr.routing(3)  # renormalised over valid slots; -1 weighs 0
    assert idx.tolist() == [[1, -1]] and w.tolist() == [[1.0, 0.0]]
    torch.testing.assert_close(tr.routing(0)[1].sum(1), torch.ones(2))


def test_csv_without_scores_any_column_order_and_spaces(tmp_path):
    tr = load_routing_file(_write(tmp_path, "e1, token ,layer,e0\r\n\n4,0,2,1\r\n 3 ,1,2,0\n\n"))
    assert not tr.has_scores and tr.layers() == [2]
    idx, w = tr.routing(2)
    assert idx.tolist() == [[1, 4], [0, 3]] and w.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_json_histograms(tmp_path):
    p = _write(tmp_path, '{"model": "mine", "layers": [0, 7], "topk": 2,\n'
                         ' "counts_per_layer": [[120, 3, 77, 0], [40, 40, 60, 60]]}', "h.json")
    h = load_routing_file(p)
    assert isinstance(h, RoutingHistogram) and h.layers() == [0, 7] and h.topk == 2 and h.num_experts == 4
    assert h.max_expert == 3 and h.counts(0).tolist() == [120, 3, 77, 0]
    assert h.counts(0, num_experts=6).tolist() == [120, 3, 77, 0, 0, 0]  # more experts: padded, no modulo
    bare = load_routing_file(_write(tmp_path, "[5, 0, 2]", "bare.json"))
    assert bare.layers() == [0] and bare.counts(0).tolist() == [5, 0, 2] and bare.topk is None


def test_format_sniffed_without_suffix(tmp_path):
    assert isinstance(load_routing_file(_write(tmp_path, GOOD_CSV, "trace.txt")), RoutingTrace)
    assert isinstance(load_routing_file(_write(tmp_path, " [1, 2]", "hist.dat")), RoutingHistogram)


BAD_CSV = [  # (kind, content, num_experts, line, col, message pattern)
    ("empty file", "", None, 1, 1, "empty file"),
    ("blank lines only", "\n  \n", None, 1, 1, "empty file"),
    ("header only", "layer,token,e0,e1\n", None, 2, 1, "no data rows"),
    ("missing column token", "layer,e0,e1\n0,1,2\n", None, 1, 12, "lacks column 'token'"),
    ("missing column e1", "layer,token,e0,e2\n0,0,1,2\n", None, 1, 18, "lacks column 'e1'"),
    ("missing score column", "layer,token,e0,e1,s0\n0,0,1,2,0.5\n", None, 1, 21, "lacks column 's1'"),
    ("unknown column", "layer,token,e0,prob\n0,0,1,0.5\n", None, 1, 16, "unknown column 'prob'"),
    ("doubled column", "layer,token,e0,e0\n0,0,1,2\n", None, 1, 16, "'e0' appears twice"),
    ("short row", "layer,token,e0,e1\n0,0,1,2\n0,1,3\n", None, 3, 6, "row has 3 fields, the header has 4"),
    ("long row", "layer,token,e0,e1\n0,0,1,2,9\n", None, 2, 8, "row has 5 fields, the header has 4"),
    ("empty value", "layer,token,e0,e1\n0,0,,2\n", None, 2, 5, "empty value in column 'e0'"),
    ("id not an integer", "layer,token,e0,e1\n0,0,1,2.5\n", None, 2, 7, "'e1': '2.5' is not an integer"),
    ("id >= num_experts", "layer,token,e0,e1\n0,0,1,2\n0,1,3,9\n", 8, 3, 7, "expert id 9 does not fit "
                                                                            "num_experts=8.*needs num_experts >= 10"),
    ("id below -1", "layer,token,e0,e1\n0,0,-2,1\n", None, 2, 5, "expert id -2 is negative"),
    ("id twice in a row", "layer,token,e0,e1\n0,0,4,4\n", None, 2, 7, "expert 4 appears twice"),
    ("token twice in a layer", "layer,token,e0\n0,0,1\n1,0,1\n0,0,2\n", None, 4, 3, "token 0 twice.*line 2"),
    ("negative token", "layer,token,e0\n0,-1,1\n", None, 2, 3, "'token': -1 is negative"),
    ("negative layer", "layer,token,e0\n-1,0,1\n", None, 2, 1, "'layer': -1 is negative"),
    ("score not a number", "layer,token,e0,s0\n0,0,1,high\n", None, 2, 7, "'s0': 'high' is not a number"),
    ("negative score", "layer,token,e0,s0\n0,0,1,-0.5\n", None, 2, 7, "score -0.5 is not a finite number >= 0"),
    ("nan score", "layer,token,e0,s0\n0,0,1,nan\n", None, 2, 7, "score nan is not a finite"),
    ("not utf-8", b"layer,token,e0\n0,0,\xff\n", None, 2, 5, "not UTF-8"),
]


@pytest.mark.parametrize("kind,text,E,line,col,msg", BAD_CSV, ids=[c[0] for c in BAD_CSV])
def test_bad_csv_names_file_line_and_column(tmp_path, kind, text, E, line, col, msg):
    p = _write(tmp_path, text)
    with pytest.raises(DataError) as ei:
        load_routing_file(p, num_experts=E)
    text = str(ei.value)
    assert "\n" not in text
    assert text.startswith(f"{p}:{line}:{col}: "), text
    assert re.search(msg, text), text


BAD_JSON = [
    ("empty file", "", None, 1, 1, "empty file"),
    ("invalid json", '{"counts_per_layer": [[1, 2,]]}', None, 1, 29, "invalid JSON"),
    ("no counts key", '{"counts": [1, 2]}', None, 1, 1, "lacks the key 'counts_per_layer'"),
    ("counts not lists", '{"counts_per_layer": 5}', None, 1, 22, "must be a non-empty list of lists"),
    ("ragged histograms", '{"counts_per_layer": [[1, 2],\n [3, 4, 5]]}', None, 2, 2,
     "histogram 1 has 3 experts, histogram 0 has 2"),
    ("empty histogram", '{"counts_per_layer": [[]]}', None, 1, 23, "histogram 0 is empty"),
    ("negative count", '{"counts_per_layer": [[1, 2],\n  [3, -4]]}', None, 2, 7, "expert 1: -4 is not an integer"),
    ("float count", "[1, 2.5]", None, 1, 5, "2.5 is not an integer count"),
    ("all zero", "[0, 0, 0]", None, 1, 1, "no positive count"),
    ("count beyond num_experts", "[4, 0, 0, 1]", 2, 1, 11, "expert 3 has routes but num_experts=2.*>= 4"),
    ("layers mismatch", '{"layers": [0], "counts_per_layer": [[1], [2]]}', None, 1, 12, "one layer number per"),
    ("layer twice", '{"layers": [3, 3], "counts_per_layer": [[1], [2]]}', None, 1, 16, "layer 3 is not a distinct"),
    ("bad topk", '{"topk": 9, "counts_per_layer": [[1, 2]]}', None, 1, 10, "'topk' must be an integer in 1..2"),
]


@pytest.mark.parametrize("kind,text,E,line,col,msg", BAD_JSON, ids=[c[0] for c in BAD_JSON])
def test_bad_json_names_file_line_and_column(tmp_path, kind, text, E, line, col, msg):
    p = _write(tmp_path, text, "h.json")
    with pytest.raises(DataError) as ei:
        load_routing_file(p, num_experts=E)
    text = str(ei.value)
    assert "\n" not in text
    assert text.startswith(f"{p}:{line}:{col}: "), text
    assert re.search(msg, text), text


def test_missing_file_and_cache_sees_edits(tmp_path):
    with pytest.raises(DataError, match=r"nope\.csv: cannot read the routing file"):
        load_routing_file(str(tmp_path / "nope.csv"))
    p = tmp_path / "r.csv"
    p.write_text("layer,token,e0\n0,0,1\n")
    assert load_routing_file(str(p)).max_expert == 1
    p.write_text("layer,token,e0\n0,0,1\n0,1,5\n")  # a different size: parsed again
    assert load_routing_file(str(p)).max_expert == 5
