"""The main job's own rank body and check (:mod:`tritonep.cli.run`) in the GPU worlds of the test suites.

`tritonep run` builds an MoE layer per traced layer (H 2048, I 1024, 64 experts, top-6, skewed real FLAME-MoE
routing), runs forward + backward on every rank and checks output and gradients against a dense reference that the
parent rebuilds from the layers' seeds. Ranks sharing a GPU under MPS see only their share of the SMs; an expert
weight draw that depended on the SM count (torch.randn on CUDA does) made every layer fail there while time-sliced
ranks passed. These tests run the job's rank body in the suite's world (time-sliced or ``--gpu-mps on``) and check
it in this process, as the CLI does, and check the ranks' expert weights against this process's bit for bit.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _settings(world_size, layers, tokens):
    from tritonep.cli.main import build_parser
    from tritonep.cli.run import _settings as settings

    args = build_parser().parse_args(["run", "--layers", *map(str, layers), "--tokens", str(tokens)])
    return settings(args, True, world_size)


def _weights_world(group, geometry, seed):
    from tritonep.moe import MoELayer

    dev = torch.device("cuda", torch.cuda.current_device())
    layer = MoELayer(__import__("tritonep").MoERecipe(), geometry, group, device=dev, seed=seed)
    out = (layer.expert_ids, layer.w1.detach().cpu(), layer.w2.detach().cpu(),
           torch.cuda.get_device_properties(dev).multi_processor_count)
    layer.close()
    return out


def test_layer_weights_equal_the_parents(gpu_world, gpu_world_size):
    """Every rank's expert weights equal those this process rebuilds (whatever SM share the ranks see)."""
    from tritonep.moe import MoEGeometry, MoELayer

    W = gpu_world_size
    geo = MoEGeometry(hidden=2048, intermediate=1024, num_experts=64, topk=6, max_tokens_per_rank=256)
    w1, w2 = MoELayer.init_expert_weights(geo, seed=1003, device="cuda:0")
    for r, (ids, a1, a2, sms) in enumerate(gpu_world(W, _weights_world, geo, 1003)):
        ids = list(ids)
        assert torch.equal(a1, w1[ids].cpu()) and torch.equal(a2, w2[ids].cpu()), \
            f"rank {r} (sees {sms} SMs): its expert weights differ from the parent's"


def test_run_layers_pass_their_check(gpu_world, gpu_world_size):
    """`tritonep run`'s rank body on layers 2 and 3 (512 tokens per layer), checked as the CLI checks it."""
    from tritonep.cli.run import TOL, check_layer, run_rank

    W = gpu_world_size
    s = _settings(W, [2, 3], 512)
    res = gpu_world(W, run_rank, s, timeout_s=400)
    for li, layer in enumerate(s["layers"]):
        errs = check_layer(s, li, layer, res, W)
        assert max(errs.values()) <= TOL["bf16"], f"layer {layer}: {errs}"
