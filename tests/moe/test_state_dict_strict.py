"""``MoELayer.load_state_dict`` reports unexpected and missing expert keys as torch does.

The layer's checkpoint keys are ``experts.<global id>.w1|w2``; loading keeps this rank's experts and drops the keys of
the model's other experts (a checkpoint of any EP size loads). Keys of expert ids beyond the model's experts were
silently dropped too (a checkpoint of a larger model loaded without a word); now they are unexpected keys, and a
missing expert of this rank is a missing key under its own name (not the internal stacked ``w1``). ``strict=True``
raises naming them; ``strict=False`` returns them and loads what is there.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep import MoEGeometry, MoELayer, MoERecipe
from tritonep.testing import run_cpu_world


def _full(layer, E, extra_experts=0):
    """A full state dict of ``E + extra_experts`` experts (expert e's tensors filled with e) and the router."""
    g = layer.geometry
    sd = {f"experts.{e}.{n}": torch.full((g.hidden, g.w1_width) if n == "w1" else (g.intermediate, g.hidden),
                                         float(e), dtype=torch.bfloat16)
          for e in range(E + extra_experts) for n in ("w1", "w2")}
    sd["router.weight"] = layer.router.weight.detach().clone()
    return sd


def _load(layer, sd, strict):
    try:
        got = layer.load_state_dict(sd, strict=strict)
        return sorted(got.missing_keys), sorted(got.unexpected_keys), None
    except RuntimeError as e:
        return None, None, str(e)


def _world(group, backend):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E = 2 * W
    layer = MoELayer(MoERecipe(), MoEGeometry(64, 32, E, 2, 8), group, seed=1, backend=backend)
    mine = list(layer.expert_ids)
    out = {}
    out["exact"] = _load(layer, _full(layer, E), True)
    bigger = _full(layer, E, extra_experts=2)  # a checkpoint of a model with 2 experts more
    out["bigger_strict"] = _load(layer, bigger, True)
    out["bigger_loose"] = _load(layer, bigger, False)
    out["took"] = layer.w1[:, 0, 0].tolist()
    odd = _full(layer, E)
    odd["experts.0.w3"] = torch.zeros(1)  # an unknown weight name
    out["odd"] = _load(layer, odd, False)
    partial = _full(layer, E)
    del partial[f"experts.{mine[1]}.w2"]
    out["partial_strict"] = _load(layer, partial, True)
    out["partial_loose"] = _load(layer, partial, False)
    none = {"router.weight": layer.router.weight.detach().clone()}  # no expert key at all
    out["none"] = _load(layer, none, False)
    layer.close()
    return out, mine, E


@pytest.mark.parametrize("W,backend", [(2, "triton"), (3, "nccl")])
def test_strict_load_reports_expert_keys_like_torch(W, backend):
    for out, mine, E in run_cpu_world(W, _world, backend, timeout_s=120):
        assert out["exact"] == ([], [], None)
        extra = [f"experts.{e}.{n}" for e in (E, E + 1) for n in ("w1", "w2")]
        err = out["bigger_strict"][2]
        assert err and "Unexpected key(s)" in err and all(f'"{k}"' in err for k in extra), err
        assert out["bigger_loose"] == ([], sorted(extra), None)
        assert out["took"] == [float(e) for e in mine]  # the model's experts loaded all the same
        assert out["odd"] == ([], ["experts.0.w3"], None)
        gone = f"experts.{mine[1]}.w2"
        err = out["partial_strict"][2]
        assert err and "Missing key(s)" in err and f'"{gone}"' in err and '"w2"' not in err, err
        assert out["partial_loose"] == ([gone], [], None)
        assert out["none"][:2] == (sorted(f"experts.{e}.{n}" for e in mine for n in ("w1", "w2")), [])


def _nested_world(group):
    """The layer inside a model: the keys carry the model's prefix; a stray key of the model is still reported."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    layer = MoELayer(MoERecipe(), MoEGeometry(64, 32, 2 * W, 2, 8), group, seed=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer)
    sd = model.state_dict()
    full = {f"1.{k}": v for k, v in _full(layer, 2 * W, extra_experts=1).items()}
    full.update({k: v for k, v in sd.items() if not k.startswith("1.")})
    full["0.stray"] = torch.zeros(1)
    del full[f"1.experts.{layer.expert_ids[0]}.w1"]
    got = model.load_state_dict(full, strict=False)
    layer.close()
    return sorted(got.missing_keys), sorted(got.unexpected_keys), layer.expert_ids[0], 2 * W


def test_prefixed_layer_inside_a_model():
    for missing, unexpected, first, E in run_cpu_world(2, _nested_world, timeout_s=120):
        assert missing == [f"1.experts.{first}.w1"]
        assert unexpected == sorted(["0.stray", f"1.experts.{E}.w1", f"1.experts.{E}.w2"])
