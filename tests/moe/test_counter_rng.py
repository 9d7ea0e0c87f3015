"""The counter-based normal draws behind the MoE layer's expert weights: a function of (key, index) only.

torch.randn on CUDA sizes its kernel grid from the SM count the process sees (MPS lowers it for ranks sharing a
GPU), so its values moved with it; these draws may not move with anything but the key and the element index.
"""

import math

import pytest
import torch

from tritonep.moe import counter_rng
from tritonep.moe.counter_rng import counter_normal, stream_key

M64 = (1 << 64) - 1


def _python_draw(key: int, i: int) -> float:
    """The spec in plain Python integers and floats: SplitMix64 finalizer, two 24-bit uniforms, Box-Muller."""
    def mix(z):
        z &= M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    z = mix(i * 0x9E3779B97F4A7C15 + mix(key))
    u1 = ((z >> 40) + 0.5) * 2.0 ** -24
    u2 = ((z >> 16) & 0xFFFFFF) * 2.0 ** -24
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def test_matches_the_python_spec():
    key = stream_key(1003, 17, 1)
    x = counter_normal(key, (64, 33), dtype=torch.float64).view(-1)
    for i in (0, 1, 2, 63, 64, 1000, 64 * 33 - 1):
        assert x[i].item() == pytest.approx(_python_draw(key, i), rel=1e-12, abs=1e-12), i


def test_independent_of_chunking_shape_and_prefix(monkeypatch):
    key = stream_key(5, 2)
    whole = counter_normal(key, (40, 50))
    monkeypatch.setattr(counter_rng, "_CHUNK", 7)
    assert torch.equal(counter_normal(key, (40, 50)), whole)  # steps of 7 elements: same bits
    assert torch.equal(counter_normal(key, (2000,)), whole.view(-1))  # shape only views the stream
    assert torch.equal(counter_normal(key, (100,)), whole.view(-1)[:100])  # a prefix is the same prefix


def test_streams_differ_and_look_normal():
    a = counter_normal(stream_key(1, 23), (200_000,), dtype=torch.float64)
    b = counter_normal(stream_key(12, 3), (200_000,), dtype=torch.float64)
    assert not torch.equal(a, b)
    for x in (a, b):
        assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
        assert abs(((x ** 4).mean() - 3).item()) < 0.1  # normal kurtosis
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.01


def test_out_is_one_rounding_of_the_float64_draw():
    key = stream_key(9)
    ref = counter_normal(key, (128, 64), dtype=torch.float64) * 0.25
    out = torch.empty(128, 64, dtype=torch.bfloat16)
    counter_normal(key, (128, 64), out=out, std=0.25)
    assert torch.equal(out, ref.to(torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        counter_normal(key, (64, 128), out=out.t())


def test_expert_weights_depend_on_seed_and_expert_only():
    from tritonep.moe import MoEGeometry, MoELayer
    from tritonep.moe.layer_parts import expert_weights

    geo = MoEGeometry(hidden=64, intermediate=32, num_experts=8, topk=2, max_tokens_per_rank=16)
    w1, w2 = MoELayer.init_expert_weights(geo, seed=3, dtype=torch.float32)
    s1, s2 = expert_weights(geo, 3, torch.float32, [6, 1])  # any subset, any order: the same rows
    assert torch.equal(s1, w1[[6, 1]]) and torch.equal(s2, w2[[6, 1]])
    o1, _ = expert_weights(geo, 4, torch.float32, [6])
    assert not torch.equal(o1[0], w1[6])
    assert abs(w1.std().item() * math.sqrt(64) - 1) < 0.05 and abs(w2.std().item() * math.sqrt(32) - 1) < 0.05
