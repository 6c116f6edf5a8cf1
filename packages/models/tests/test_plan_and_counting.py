"""The sharding description and the parameter / FLOP counts."""

import mindspore as ms
import numpy as np

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
