"""MindFormers' checkpoint names of models built without optional parts (issue 34):
``qk_layernorm: false`` (DeepSeek-V3, Qwen3-MoE, DeepSeek-V4 in both attention variants: no
q/k layernorm tensors; V4's fixed query norm constant stays) and DeepSeek-V4's
``enable_hyper_connections: false`` (no attn_hc / ffn_hc / hc_head tensors, nor their
constant companions): every parameter the config plan lists has its MindFormers place, and
the absent parts have none."""

import json

import pytest

from mindtrain.config import ModelConfig
from mindtrain.config.model_plan import param_specs
from mindtrain.trainer.mindformers_names import companion_boxes, placements

CONFIGS = {
    "deepseek_v3": dict(model_type="deepseek_v3", architectures="DeepseekV3ForCausalLM", vocab_size=64,
                        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, num_nextn_predict_layers=1,
                        qk_layernorm=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, qk_layernorm=False),
    "deepseek_v4": dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", vocab_size=64,
                        hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4,
                        num_experts_per_tok=2, compress_ratios=[4, 0, 0], o_groups=2, o_lora_rank=8,
                        index_n_heads=2, index_head_dim=16, index_topk=2, num_hash_layers=1,
                        scoring_func="sqrtsoftplus", num_nextn_predict_layers=1, enable_hyper_connections=False,
                        enable_hc_head=False),
}
_V4 = {k: v for k, v in CONFIGS["deepseek_v4"].items() if k not in ("enable_hyper_connections", "enable_hc_head")}
# DeepSeek-V4 with qk_layernorm: false in both attention variants (hyper-connections on)
CONFIGS["deepseek_v4_no_qk_norm"] = dict(_V4, qk_layernorm=False)
CONFIGS["deepseek_v4_mla_no_qk_norm"] = dict(_V4, qk_layernorm=False, experimental_attention_variant="mla",
                                             kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_parameter_has_its_place_and_the_absent_parts_none(family):
    cfg = ModelConfig(**CONFIGS[family])
    theirs = {pl.theirs for p in param_specs(cfg) for pl in placements(p.name, p.shape, cfg)}
    assert theirs
    absent = ("_hc.", "hc_head") if family == "deepseek_v4" else ("q_layernorm", "k_layernorm", "kv_layernorm")
    assert not [t for t in theirs if any(a in t for a in absent)]
    # no constant companions of parts that are not there
    made = {c[0] for t in theirs for c in companion_boxes(t, (0, 0, 0), (1, 1, 1), cfg)}
    if family == "deepseek_v4":
        assert not [c for c in made if "_hc." in c]  # V4's hyper-connection rms_weight constants
    if family == "deepseek_v4_no_qk_norm":  # the fixed per-head query norm stays without kv_layernorm
        assert sorted(c for c in made if c.endswith("q_rms_gamma")) == [
            "decoder.layers.0.self_attention.q_rms_gamma", "decoder.layers.1.self_attention.q_rms_gamma",
            "mtp.layers.0.transformer_layer.self_attention.q_rms_gamma"]
        # the compressors' and the indexer's norms stay (MindFormers' Compressor always builds one)
        assert "decoder.layers.0.self_attention.core_attention.indexer.compressor.norm.weight" in theirs
    if family == "deepseek_v4_mla_no_qk_norm":
        assert not [c for c in made if c.endswith("q_rms_gamma")]


@pytest.mark.parametrize("family, field", [("deepseek_v3", "qk_layernorm"), ("qwen3_moe", "qk_layernorm"),
                                           ("deepseek_v4", "enable_hyper_connections"),
                                           ("deepseek_v4_no_qk_norm", "qk_layernorm")])
def test_export_hf_refuses_in_one_line(family, field, tmp_path, capsys):
    """HF has no model without these parts: mindtrain-export-hf stops before writing anything
    (the folder's config.json is what a checkpoint of such a model holds)."""
    from mindtrain.models import config_to_hf
    from mindtrain.trainer import sharded
    from mindtrain.trainer.export_hf import main

    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    (folder / sharded.METADATA_FILE).write_text("{}")
    (folder / "config.json").write_text(json.dumps(config_to_hf(ModelConfig(**CONFIGS[family]))))
    assert main([str(folder), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mindtrain-export-hf: model.{field}: false") and "\n" not in err
    assert not (tmp_path / "hf").exists()
