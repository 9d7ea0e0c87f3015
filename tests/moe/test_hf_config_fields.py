"""``config_from_hf`` maps or refuses every field of a transformers MoE config that changes what the block computes.

Mixtral's ``router_jitter_noise`` was silently dropped: now it is ``RouterConfig.jitter_noise`` and the layer, in
training, multiplies its tokens by the same uniform noise as transformers' block (checked against the block itself,
same seed, same input). A DeepSeek config with another ``scoring_func`` / ``topk_method`` than the layer computes is
refused unless the caller names the field in ``ignore``. And every field of every supported model's config is
accounted for below (mapped, refused when unsupported, or outside the MoE block), so a field a new transformers
release adds fails this test until someone decides what it means for the layer.
"""

import math

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig  # noqa: E402

from tritonep.errors import ConfigError  # noqa: E402
from tritonep.moe import MoELayer  # noqa: E402
from tritonep.moe.hf_import import config_from_hf, load_hf_moe_block  # noqa: E402
from tritonep.testing import run_cpu_world  # noqa: E402

transformers.logging.set_verbosity_error()
_SMALL = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=32)

# what the MoE block computes from, per model (read by config_from_hf) ...
MAPPED = {"model_type", "hidden_size", "hidden_act", "num_experts_per_tok", "router_aux_loss_coef",
          "output_router_logits", "num_local_experts", "intermediate_size", "router_jitter_noise", "num_experts",
          "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size", "n_routed_experts",
          "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "scoring_func", "topk_method"}
# ... and the rest of a config: the model around its MoE blocks (attention, norms, embeddings, which layers are MoE,
# generation / serialisation settings), none of which the block's computation reads
OUTSIDE = {"architectures", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
           "tie_word_embeddings", "torch_dtype", "dtype", "id2label", "label2id", "return_dict", "output_hidden_states",
           "output_attentions", "use_cache", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type",
           "tokenizer_class", "task_specific_params", "add_cross_attention", "cross_attention_hidden_size",
           "tf_legacy_loss", "pruned_heads", "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id",
           "use_bfloat16", "torchscript", "is_decoder", "attention_dropout", "head_dim", "initializer_range",
           "max_position_embeddings", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
           "rms_norm_eps", "rope_parameters", "sliding_window", "vocab_size", "decoder_sparse_step", "layer_types",
           "max_window_layers", "mlp_only_layers", "qkv_bias", "use_sliding_window", "attention_bias", "clip_qkv",
           "first_k_dense_replace", "kv_lora_rank", "num_nextn_predict_layers", "pretraining_tp", "q_lora_rank",
           "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "rope_interleave", "v_head_dim"}
CONFIGS = (MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, OlmoeConfig, DeepseekV3Config)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_is_accounted_for(cls):
    fields = {k for k in cls().to_dict() if not k.startswith("_")}
    unknown = sorted(fields - MAPPED - OUTSIDE)
    assert not unknown, f"{cls.__name__} has fields config_from_hf neither maps nor refuses: {unknown}"


def test_mixtral_jitter_is_mapped_and_deepseek_options_refused():
    recipe, _ = config_from_hf(MixtralConfig(router_jitter_noise=0.1, **_SMALL), 8)
    assert recipe.router.jitter_noise == 0.1
    recipe, _ = config_from_hf(MixtralConfig(router_jitter_noise=0.1, **_SMALL), 8, ignore=("router_jitter_noise",))
    assert recipe.router.jitter_noise == 0.0
    for field, value in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        cfg = DeepseekV3Config(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, **_SMALL)
        setattr(cfg, field, value)  # as a DeepSeek checkpoint's config.json carries it
        with pytest.raises(ConfigError, match=f"config.{field}={value!r}"):
            config_from_hf(cfg, 8)
        config_from_hf(cfg, 8, ignore=(field,))  # the caller accepts the difference
    ok = DeepseekV3Config(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, **_SMALL)
    ok.scoring_func, ok.topk_method = "sigmoid", "noaux_tc"  # what the layer computes: accepted
    config_from_hf(ok, 8)


def _jitter_world(group, backend):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    rank = dist.get_rank(group)
    cfg = MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.2,
                        **_SMALL)
    block = MixtralSparseMoeBlock(cfg).float()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(block.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (3.0 if p.dim() == 2 and p.shape[0] == 4 else 1.0)
                    / math.sqrt(p.shape[-1]))
    recipe, geo = config_from_hf(cfg, max_tokens_per_rank=8)
    layer = MoELayer(recipe, geo, group, dtype=torch.float32, backend=backend)
    load_hf_moe_block(layer, block)
    layer.train()
    block.train()
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(rank)).bfloat16().float()
    out = {}
    for name, fn in (("ours", layer), ("theirs", block)):
        torch.manual_seed(11 + rank)  # the same noise draw on both sides
        out[name] = fn(x.clone()).detach()
    torch.manual_seed(11 + rank)
    out["plain"] = layer.eval()(x.clone()).detach()  # eval: no jitter
    layer.close()
    return out


@pytest.mark.slow
def test_mixtral_jitter_equals_transformers_block_in_training():
    for out in run_cpu_world(2, _jitter_world, "triton", timeout_s=120):
        ours, theirs = out["ours"].float(), out["theirs"].float()
        assert ours.shape == theirs.shape == (1, 6, 64)
        err = float((ours - theirs).abs().max() / theirs.abs().max())
        assert err < 2e-2, err  # bf16 tokens and rows on our side (tests/moe/test_hf_equality.py: TOL)
        assert float((out["plain"] - theirs).abs().max() / theirs.abs().max()) > 4 * err  # the jitter mattered
