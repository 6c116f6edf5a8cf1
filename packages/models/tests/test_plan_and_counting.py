"""The sharding description and the parameter / FLOP counts."""

import mindspore as ms
import numpy as np
import pytest

import mindtrain.models as mm
from mindtrain.config import ModelConfig

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
           num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
           qk_nope_head_dim=8, v_head_dim=8, seq_length=16, max_position_embeddings=64, num_nextn_predict_layers=1)


def test_plan_covers_every_parameter():
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**CFG), jit=False)
    plan = model.parallel_plan()
    names = [p.name for p in model.get_parameters()]
    assert sorted(plan["params"]) == sorted(names)
    assert [u["name"] for u in plan["units"]] == ["embedding", "layers.0", "layers.1", "layers.2", "head", "mtp.0"]
    assert sorted(n for u in plan["units"] for n in u["params"]) == sorted(names)
    p = plan["params"]
    assert p["model.embed_tokens.weight"]["tp"] == "vocab"
    assert (p["model.layers.0.self_attn.q_b_proj.weight"]["tp"], p["model.layers.0.self_attn.q_b_proj.weight"]["tp_dim"]) == ("column", 0)
    assert (p["model.layers.0.self_attn.o_proj.weight"]["tp"], p["model.layers.0.self_attn.o_proj.weight"]["tp_dim"]) == ("row", 1)
    assert p["model.layers.0.self_attn.q_a_proj.weight"]["tp"] == "replicated"
    ex = p["model.layers.1.mlp.experts.down_proj"]
    assert ex["expert"] and ex["expert_dim"] == 0 and ex["shape"][0] == 4 and ex["num_experts"] == 4
    assert (ex["tp"], ex["tp_dim"]) == ("row", 2)
    assert not p["model.layers.1.mlp.gate.e_score_correction_bias"]["trainable"]
    assert p["model.layers.3.eh_proj.weight"]["unit"] == "mtp.0"
    assert plan["shared"]["lm_head.weight"] == ["head", "mtp.0"]
    # column splits along the head dimension keep heads whole
    assert p["model.layers.0.self_attn.kv_b_proj.weight"]["shape"][0] % CFG["num_attention_heads"] == 0


def test_counts_match_the_model():
    ms.set_seed(0)
    cfg = ModelConfig(**CFG)
    model = mm.build_model(cfg, jit=False)
    total, active = mm.count_parameters(cfg)
    assert total == sum(int(np.prod(p.shape)) for p in model.trainable_params())
    expert = 3 * 32 * 16
    assert total - active == 3 * expert * 2  # 3 MoE blocks (2 layers + MTP), 2 of 4 experts idle
    flops = mm.flops_per_token(cfg, 16)
    embed = 64 * 32
    assert 6 * (active - embed) < flops < 6 * (active + embed) + 6 * 2 * 16 * 28 * 4


def test_plan_roles_regions_and_split_fields():
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**CFG), jit=False)
    plan = model.parallel_plan()
    p = plan.params
    assert p["model.embed_tokens.weight"].role == "embedding" and p["lm_head.weight"].role == "head"
    assert p["model.norm.weight"].role == "head" and p["model.layers.0.input_layernorm.weight"].role is None
    assert p["model.layers.0.self_attn.q_b_proj.weight"].role == "attention"
    assert p["model.layers.0.mlp.down_proj.weight"].role == "mlp"
    assert p["model.layers.1.mlp.experts.down_proj"].role == "moe" and p["model.layers.1.mlp.gate.weight"].role == "moe"
    assert p["lm_head.weight"].split_field == p["model.embed_tokens.weight"].split_field == "model.vocab_size"
    assert p["model.layers.1.mlp.experts.up_proj"].split_field == "model.moe_intermediate_size"
    assert p["model.layers.0.self_attn.o_proj.weight"].split_field == "model.num_attention_heads"
    assert p["model.layers.0.self_attn.q_a_proj.weight"].split_field is None
    cells = dict(model.cells_and_names())
    # every decoder and MTP layer's attention and MLP/MoE block is a region; every region is a cell
    assert plan.role_regions("attention") == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert plan.role_regions("mlp") == ["model.layers.0.mlp"]
    assert plan.role_regions("moe") == [f"model.layers.{i}.mlp" for i in (1, 2, 3)]
    assert all(r.path in cells for r in plan.regions)
    assert [u.path for u in plan.units] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                             "model.layers.2", None, "model.layers.3"]
    assert [n for n, q in p.items() if q.applied_outside] == ["model.layers.3.shared_head.norm.weight"]


# the config's parameter plan (mindtrain.config.model_plan) against the model built from it:
# dense and MoE layers with q LoRA and an MTP module; no q LoRA, attention biases, every layer
# MoE with two shared experts, no MTP; two MTP modules after two dense layers, no shared expert
QWEN3 = dict(model_type="qwen3", architectures="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, seq_length=16,
             max_position_embeddings=64)
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", architectures="Qwen3MoeForCausalLM", num_hidden_layers=4,
                 moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                 mlp_only_layers=[3])
PLAN_CONFIGS = {
    "dense_moe_mtp": dict(CFG),
    "no_q_lora_bias_all_moe": dict(CFG, q_lora_rank=None, attention_bias=True, first_k_dense_replace=0,
                                   n_shared_experts=2, num_nextn_predict_layers=0),
    "two_mtp_no_shared": dict(CFG, num_hidden_layers=2, first_k_dense_replace=2, n_shared_experts=0,
                              num_nextn_predict_layers=2),
    # Qwen3: GQA with head_dim != hidden / heads and q/k/v/o biases; a tied head (no head_dim:
    # hidden / heads); Qwen3-MoE with decoder_sparse_step 2 and layer 3 in mlp_only_layers
    "qwen3_bias": dict(QWEN3, attention_bias=True),
    "qwen3_tied": dict(QWEN3, tie_word_embeddings=True, head_dim=None),
    "qwen3_moe": dict(QWEN3_MOE),
    # DeepSeek-V4: every attention kind (sliding, compressed sparse with the indexer, heavily
    # compressed at ratio 8), hash and learned routers, 3 hyper-connection streams, 2 shared experts
    "deepseek_v4": dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", vocab_size=64,
                        hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=2, compress_ratios=[0, 4, 8], o_groups=2,
                        o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=2, hc_mult=3,
                        num_hash_layers=1, seq_length=16, max_position_embeddings=64),
}


@pytest.mark.parametrize("name", list(PLAN_CONFIGS))
def test_the_config_plan_is_the_models_parameters(name):
    """Every trainable parameter the model builds, by name and shape, in the model's order, is
    the plan's; the plan's TP split, expert flag and unit are the model's parallel plan's."""
    from mindtrain.config.model_plan import param_specs, units

    cfg = ModelConfig(**PLAN_CONFIGS[name])
    model = mm.build_model(cfg, jit=False, empty=True)
    specs = param_specs(cfg)
    assert [(p.name, p.shape) for p in specs] == [(p.name, tuple(p.shape)) for p in model.trainable_params()]
    plan = mm.parallel_plan(model)
    for p in specs:
        info = plan.params[p.name]
        assert (p.tp, p.tp_dim, p.expert, p.unit) == (info.tp, info.tp_dim, info.expert, info.unit), p.name
    trainable = {p.name for p in specs}
    assert [(u.name, u.kind, u.layer, u.path, u.params) for u in units(cfg)] == \
        [(u.name, u.kind, u.layer, u.path, [n for n in u.params if n in trainable]) for u in plan.units]
    total, _ = mm.count_parameters(cfg)
    assert total == sum(int(np.prod(p.shape)) for p in model.trainable_params())


def test_qwen3_plan_splits_counts_and_flops():
    """GQA's k/v projections split by key/value heads, per-head norms and the router stay whole,
    a tied head shares the embedding; counts and FLOPs by hand."""
    cfg = ModelConfig(**dict(QWEN3_MOE, attention_bias=True, tie_word_embeddings=True))
    model = mm.build_model(cfg, jit=False, empty=True)
    plan = model.parallel_plan()
    p = plan.params
    a = "model.layers.0.self_attn."
    assert (p[a + "k_proj.weight"].tp, p[a + "k_proj.weight"].tp_dim) == ("column", 0)
    assert p[a + "k_proj.weight"].split_field == p[a + "v_proj.bias"].split_field == "model.num_key_value_heads"
    assert (p[a + "q_proj.bias"].tp, p[a + "q_proj.weight"].split_field) == ("column", "model.num_attention_heads")
    assert (p[a + "o_proj.weight"].tp, p[a + "o_proj.bias"].tp) == ("row", "replicated")
    assert p[a + "q_norm.weight"].tp == p[a + "k_norm.weight"].tp == "replicated"
    assert p["model.layers.1.mlp.gate.weight"].tp == "replicated" and p["model.layers.1.mlp.experts.up_proj"].expert
    assert "lm_head.weight" not in p and plan.shared == {"model.embed_tokens.weight": ["embedding", "head"]}
    assert plan.role_regions("attention") == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert plan.role_regions("moe") == ["model.layers.1.mlp"]
    assert plan.role_regions("mlp") == [f"model.layers.{i}.mlp" for i in (0, 2, 3)]
    assert [u.params for u in plan.units if u.name == "head"] == [["model.norm.weight"]]
    h, v, d, n, kv = 32, 64, 16, 4, 2
    attention = (h + 1) * n * d + 2 * (h + 1) * kv * d + (n * d + 1) * h + 2 * d
    dense, expert = 3 * h * 48, 3 * h * 16
    layers = 4 * (attention + 2 * h) + 3 * dense + 4 * h + 4 * expert
    total, active = mm.count_parameters(cfg)
    assert total == v * h + layers + h == sum(int(np.prod(q.shape)) for q in model.trainable_params())
    assert total - active == 2 * expert  # 2 of 4 experts idle in the one MoE layer
    norms = 4 * (2 * h + 2 * d) + h
    matmul = active - v * h - norms + v * h  # the tied head's matmul counts once
    assert mm.flops_per_token(cfg, 16) == 6 * matmul + 6 * n * 16 * (2 * d) * 4
