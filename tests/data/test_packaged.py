"""Packaged real routing data: loaders return the file's real numbers; splitting and sampling helpers."""

from importlib import resources

import pytest
import torch

from tritonep.data import (
    flame_layers,
    load_flame_trace,
    load_olmoe_histogram,
    olmoe_domains,
    olmoe_layers,
    sample_routing,
    scale_histogram_to_experts,
    split_across_ranks,
)
from tritonep.errors import DataError


def test_package_files_present_with_license():
    root = resources.files("tritonep.data")
    for name in ("prefill_2048tok_layers2-9_top6.csv", "olmoe_expert_counts.json", "README.md", "LICENSE-DATA.md"):
        assert root.joinpath(name).is_file(), name
    lic = root.joinpath("LICENSE-DATA.md").read_text()
    assert "Apache License" in lic and "CMU-FLAME" in lic and "allenai/OLMoE" in lic


def test_flame_layers_and_shapes():
    assert flame_layers() == list(range(2, 10))
    for layer in (2, 9):
        idx, w = load_flame_trace(layer)
        assert idx.shape == (2048, 6) and idx.dtype == torch.int64
        assert w.shape == (2048, 6) and w.dtype == torch.float32
        assert int(idx.min()) >= 0 and int(idx.max()) <= 63
        # distinct ids per row, probabilities descending, positive, < 1 in total
        assert (idx.sort(dim=1).values.diff(dim=1) > 0).all()
        assert (w.diff(dim=1) <= 0).all() and (w > 0).all() and (w.sum(1) < 1).all()


@pytest.mark.parametrize(
    "layer,token,ids,probs",
    [  # rows copied by hand from prefill_2048tok_layers2-9_top6.csv
        (2, 0, [34, 28, 21, 47, 3, 12], [0.099801, 0.052281, 0.041714, 0.038429, 0.032560, 0.029556]),
        (2, 1, [1, 38, 16, 21, 47, 34], [0.068381, 0.050470, 0.037007, 0.031374, 0.030454, 0.030104]),
        (5, 1000, [55, 18, 46, 16, 54, 34], [0.320655, 0.072724, 0.038664, 0.031311, 0.030973, 0.025924]),
        (9, 2047, [53, 39, 18, 62, 11, 5], [0.101036, 0.096387, 0.086673, 0.049139, 0.044179, 0.039321]),
    ],
)
def test_flame_rows_match_csv(layer, token, ids, probs):
    idx, w = load_flame_trace(layer)
    assert idx[token].tolist() == ids
    assert torch.equal(w[token], torch.tensor(probs, dtype=torch.float64).to(torch.float32))


def test_flame_renormalize_and_fresh_copies():
    idx, w = load_flame_trace(3, renormalize=True)
    torch.testing.assert_close(w.sum(1), torch.ones(2048), atol=1e-6, rtol=0)
    idx[0, 0] = -5  # callers may modify what they get; the cache stays intact
    assert int(load_flame_trace(3)[0][0, 0]) != -5


def test_flame_bad_layer():
    with pytest.raises(DataError, match=r"no layer 10.*\[2, 3, 4, 5, 6, 7, 8, 9\]"):
        load_flame_trace(10)
    with pytest.raises(DataError):
        load_flame_trace(1)


def test_split_even():
    idx, w = load_flame_trace(2)
    parts = split_across_ranks(idx, w, 3)
    assert [p[0].shape[0] for p in parts] == [683, 683, 682]
    assert torch.equal(torch.cat([p[0] for p in parts]), idx) and torch.equal(torch.cat([p[1] for p in parts]), w)
    parts = split_across_ranks(idx, w, 4, num_tokens=10)
    assert [p[0].shape[0] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), idx[:10])


def test_split_uneven_and_empty_rank():
    idx, w = load_flame_trace(4)
    parts = split_across_ranks(idx, w, 4, num_tokens=100, uneven=True)
    assert [p[0].shape[0] for p in parts] == [10, 20, 30, 40]
    parts = split_across_ranks(idx, w, 4, num_tokens=100, empty_rank=2)
    assert [p[0].shape[0] for p in parts] == [34, 33, 0, 33]
    assert parts[2][0].shape == (0, 6) and parts[2][1].shape == (0, 6)
    parts = split_across_ranks(idx, w, 3, num_tokens=101, uneven=True, empty_rank=0)
    assert [p[0].shape[0] for p in parts] == [0, 33, 68]
    assert torch.equal(torch.cat([p[0] for p in parts]), idx[:101])
    parts = split_across_ranks(idx, w, 3, num_tokens=[5, 0, 7])
    assert [p[0].shape[0] for p in parts] == [5, 0, 7] and torch.equal(parts[2][0], idx[5:12])


def test_split_errors():
    idx, w = load_flame_trace(2)
    with pytest.raises(DataError, match="world_size"):
        split_across_ranks(idx, w, 0)
    with pytest.raises(DataError, match="empty_rank=4"):
        split_across_ranks(idx, w, 4, empty_rank=4)
    with pytest.raises(DataError, match="num_tokens=5000"):
        split_across_ranks(idx, w, 2, num_tokens=5000)
    with pytest.raises(DataError):
        split_across_ranks(idx, w, 2, num_tokens=[1, 2, 3])
    with pytest.raises(DataError):
        split_across_ranks(idx, w[:5], 2)


def test_olmoe_histogram():
    assert olmoe_domains() == ["arxiv", "book", "c4", "github", "wikipedia", "tulu"]
    assert olmoe_layers() == [0, 7, 15]
    h = load_olmoe_histogram()
    assert h.shape == (64,) and h.dtype == torch.int64
    assert h[:5].tolist() == [204013, 19281, 19395, 32186, 38809]  # arxiv layer 0, read from the JSON by hand
    assert int(h.sum()) == 208896 * 8
    assert load_olmoe_histogram("github", 15)[:3].tolist() == [30851, 83461, 5138]
    for dom in olmoe_domains():
        tokens = 205243 if dom == "tulu" else 208896
        for layer in olmoe_layers():
            assert int(load_olmoe_histogram(dom, layer).sum()) == tokens * 8


def test_olmoe_errors():
    with pytest.raises(DataError, match=r"no domain 'reddit'.*arxiv"):
        load_olmoe_histogram("reddit")
    with pytest.raises(DataError, match=r"no layer 3.*\[0, 7, 15\]"):
        load_olmoe_histogram("arxiv", 3)


def test_sample_routing_shapes_distinct_deterministic():
    h = load_olmoe_histogram("arxiv", 0)
    idx, w = sample_routing(h, 500, 8, generator=123)
    assert idx.shape == (500, 8) and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert (idx.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct experts per token
    assert (w > 0).all()
    torch.testing.assert_close(w.sum(1), torch.ones(500), atol=1e-6, rtol=0)
    idx2, w2 = sample_routing(h, 500, 8, generator=123)
    assert torch.equal(idx, idx2) and torch.equal(w, w2)
    idx3, _ = sample_routing(h, 500, 8, generator=124)
    assert not torch.equal(idx, idx3)
    g = torch.Generator().manual_seed(123)
    assert torch.equal(sample_routing(h, 500, 8, generator=g)[0], idx)
    e_idx, e_w = sample_routing(h, 0, 8)
    assert e_idx.shape == (0, 8) and e_w.shape == (0, 8)


def test_sample_routing_follows_histogram():
    h = load_olmoe_histogram("arxiv", 0)
    p = h.double() / h.sum()
    idx, _ = sample_routing(h, 20000, 4, generator=7)
    # first draw of each token is a plain draw from p
    freq = torch.bincount(idx[:, 0], minlength=64).double() / 20000
    assert (freq - p).abs().max() < 0.01
    # over all slots the hot expert is still the most used and zero-ish experts stay rare
    all_freq = torch.bincount(idx.flatten(), minlength=64)
    assert int(all_freq.argmax()) == int(h.argmax())
    hot, cold = h.argsort()[-8:], h.argsort()[:8]
    assert all_freq[hot].sum() > 4 * all_freq[cold].sum()


def test_sample_routing_zero_experts_and_errors():
    h = torch.tensor([5, 0, 3, 0])
    idx, _ = sample_routing(h, 50, 2, generator=1)
    assert set(idx.flatten().tolist()) == {0, 2}
    with pytest.raises(DataError, match="topk=3"):
        sample_routing(h, 10, 3)
    with pytest.raises(DataError, match="negative"):
        sample_routing(torch.tensor([1, -1, 2]), 4, 1)
    with pytest.raises(DataError):
        sample_routing(h, -1, 1)


def test_scale_histogram():
    h = load_olmoe_histogram("c4", 7)
    s = scale_histogram_to_experts(h, 256)
    assert s.shape == (256,) and s.dtype == h.dtype
    assert torch.equal(s, h.repeat(4))
    s = scale_histogram_to_experts(h, 100)
    assert torch.equal(s[:64], h) and torch.equal(s[64:], h[:36])
    f = scale_histogram_to_experts(h, 16)
    assert int(f.sum()) == int(h.sum()) and int(f[3]) == int(h[3::16].sum())
    assert torch.equal(scale_histogram_to_experts(torch.tensor([1, 2, 3, 4]), 2), torch.tensor([4, 6]))
    with pytest.raises(DataError, match="num_experts"):
        scale_histogram_to_experts(h, 0)
