"""Bad model configs end in one-line ConfigErrors naming the field."""

import dataclasses

import pytest

import mindtrain.models as mm
from mindtrain.config import ConfigError, ModelConfig

GOOD = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, seq_length=16, max_position_embeddings=64)


@pytest.mark.parametrize("change, field", [
    (dict(model_type="llama"), "model.model_type"),
    (dict(architectures="LlamaForCausalLM"), "model.architectures"),
    (dict(n_routed_experts=6), "model.n_routed_experts"),
    (dict(topk_group=5), "model.topk_group"),
    (dict(num_experts_per_tok=5), "model.num_experts_per_tok"),
    (dict(num_key_value_heads=1), "model.num_key_value_heads"),
    (dict(qk_rope_head_dim=5), "model.qk_rope_head_dim"),
    (dict(hidden_size=0), "model.hidden_size"),
    (dict(first_k_dense_replace=3), "model.first_k_dense_replace"),
])
def test_bad_config_one_line_error(change, field):
    cfg = ModelConfig(**{**GOOD, **change})
    with pytest.raises(ConfigError) as err:
        mm.build_model(cfg, jit=False)
    assert err.value.path == field
    assert "\n" not in str(err.value)


def test_config_from_hf_official_form():
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 4096, "type": "yarn"},
          "rope_theta": 10000, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
          "quantization_config": {"fmt": "e4m3"}, "eos_token_id": [1, 2]}
    cfg = mm.config_from_hf(hf, seq_length=128)
    assert cfg.architectures == "DeepseekV3ForCausalLM" and cfg.rope_scaling["factor"] == 40
    assert cfg.seq_length == 128 and cfg.eos_token_id == 1
    back = mm.config_to_hf(cfg)
    assert back["architectures"] == ["DeepseekV3ForCausalLM"] and back["hidden_size"] == 7168
    assert dataclasses.asdict(mm.config_from_hf(back)) == dataclasses.asdict(cfg)


def test_config_from_hf_transformers5_form():
    hf = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0,
                              "original_max_position_embeddings": 64}}
    cfg = mm.config_from_hf(hf)
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling["rope_type"] == "yarn" and "rope_theta" not in cfg.rope_scaling
