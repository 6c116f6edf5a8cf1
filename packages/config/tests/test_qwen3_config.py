"""The Qwen3 / Qwen3-MoE model section: HF and MindFormers names, per-family validation, the
parameter plan's counts by hand."""

import pytest

from mindtrain.config import ConfigError, ModelConfig, from_dict, validate_model
from mindtrain.config.families import FAMILY_FIELDS, has_moe, head_dim, moe_layer_ids
from mindtrain.config.model_names import to_canonical, to_mindformers
from mindtrain.config.model_plan import count_parameters, flops_per_token, param_specs, tp_split

QWEN3 = dict(model_type="qwen3", architectures="Qwen3ForCausalLM", vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             seq_length=16, max_position_embeddings=64)
MOE = dict(QWEN3, model_type="qwen3_moe", architectures="Qwen3MoeForCausalLM", num_hidden_layers=4,
           moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2)


def _model(section):
    m = from_dict(ModelConfig, section, "model")
    validate_model(m)
    return m


def test_every_field_belongs_to_a_family():
    import dataclasses

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set().union(*FAMILY_FIELDS.values()) == names
    assert {"head_dim", "tie_word_embeddings"} < FAMILY_FIELDS["qwen3"]
    assert "mlp_only_layers" in FAMILY_FIELDS["qwen3_moe"] and "mlp_only_layers" not in FAMILY_FIELDS["qwen3"]


def test_moe_layers_follow_hf():
    assert moe_layer_ids(ModelConfig(**MOE)) == [0, 1, 2, 3]
    assert moe_layer_ids(ModelConfig(**dict(MOE, decoder_sparse_step=2, mlp_only_layers=[3]))) == [1]
    assert moe_layer_ids(ModelConfig(**dict(MOE, n_routed_experts=0))) == []
    assert not has_moe(ModelConfig(**QWEN3))
    ds = ModelConfig(num_hidden_layers=4, first_k_dense_replace=1, num_nextn_predict_layers=1)
    assert moe_layer_ids(ds) == [1, 2, 3, 4]
    assert head_dim(ModelConfig(**dict(QWEN3, head_dim=None))) == 8


# (MindFormers name, value, field, what the field gets)
RENAMED = [
    ("kv_channels", 32, "head_dim", 32),
    ("num_query_groups", 1, "num_key_value_heads", 1),
    ("ffn_hidden_size", 96, "intermediate_size", 96),
    ("num_layers", 3, "num_hidden_layers", 3),
    ("layernorm_epsilon", 1e-5, "rms_norm_eps", 1e-5),
    ("init_method_std", 0.01, "initializer_range", 0.01),
    ("rotary_base", 1e6, "rope_theta", 1e6),
    ("add_qkv_bias", True, "attention_bias", True),
    ("untie_embeddings_and_output_weights", False, "tie_word_embeddings", True),
    ("params_dtype", "bf16", "param_init_dtype", "bfloat16"),
    ("num_moe_experts", 16, "n_routed_experts", 16),
    ("num_experts", 16, "n_routed_experts", 16),
    ("num_local_experts", 16, "n_routed_experts", 16),
    ("moe_router_topk", 4, "num_experts_per_tok", 4),
    ("moe_ffn_hidden_size", 24, "moe_intermediate_size", 24),
    ("moe_router_dtype", "fp32", "router_dense_type", "float32"),
    ("moe_aux_loss_coeff", 0.01, "router_aux_loss_coef", 0.01),
]


@pytest.mark.parametrize("mf, value, field, expected", RENAMED, ids=[r[0] for r in RENAMED])
def test_mindformers_qwen3_names(mf, value, field, expected):
    section = {k: v for k, v in MOE.items() if k != field}
    got = _model(dict(section, **{mf: value}))
    assert getattr(got, field) == expected
    same = _model(dict(section, **{field: expected}))
    if mf == "moe_aux_loss_coeff":  # MindFormers adds its aux loss whenever the coefficient is > 0
        assert got.output_router_logits and not same.output_router_logits
        return
    assert got == same


def test_mindformers_moe_layer_freq_and_balance_switch():
    assert _model(dict(MOE, moe_layer_freq=2)).mlp_only_layers == [1, 3]  # Megatron: MoE where i % N == 0
    assert _model(dict(MOE, moe_layer_freq=[1, 0, 1, 1])).mlp_only_layers == [1]
    with pytest.raises(ConfigError, match=r"^model\.moe_layer_freq: must list 0 \(dense\) or 1"):
        _model(dict(MOE, moe_layer_freq=[1, 0]))
    off = _model(dict(MOE, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="none"))
    assert (off.router_aux_loss_coef, off.output_router_logits) == (0.01, False)
    # the registered MindFormers defaults of a Qwen3-MoE are accepted
    _model(dict(MOE, moe_router_score_function="softmax", moe_router_enable_expert_bias=False, normalization="RMSNorm",
                qk_layernorm=True, multi_latent_attention=False, gated_linear_unit=True, add_bias_linear=False,
                position_embedding_type="rope", moe_router_topk_scaling_factor=1.0, hidden_act="swiglu"))


@pytest.mark.parametrize("field, value", [
    ("multi_latent_attention", True), ("moe_router_score_function", "sigmoid"),
    ("moe_router_enable_expert_bias", True), ("moe_router_topk_scaling_factor", 2.5),
    ("moe_router_load_balancing_type", "gbs_aux_loss"), ("position_embedding_type", "yarn"),
    ("use_sliding_window", True), ("moe_shared_expert_intermediate_size", 64),
])
def test_values_of_another_model_are_refused(field, value):
    with pytest.raises(ConfigError, match=rf"^model\.{field}: .* is not supported"):
        _model(dict(MOE, **{field: value}))


def test_qk_layernorm_false_is_built():
    # MindFormers' GPT attention takes IdentityOp for q_layernorm / k_layernorm when it is false
    assert _model(dict(MOE, qk_layernorm=False)).qk_layernorm is False
    assert _model(dict(QWEN3, qk_layernorm=False, multi_latent_attention=False)).qk_layernorm is False


@pytest.mark.parametrize("section, error", [
    (dict(MOE, mtp_num_layers=1), r"^model\.mtp_num_layers: is a DeepSeek-V3 setting"),
    (dict(MOE, rotary_scaling_factor=4), r"^model\.rotary_scaling_factor: is DeepSeek-V3's YaRN setting"),
    (dict(MOE, first_k_dense_replace=1), r"^model\.first_k_dense_replace: is a DeepSeek-V3 setting, which a "
                                         r"qwen3_moe model does not read; .* mlp_only_layers"),
    (dict(QWEN3, mlp_only_layers=[1]), r"^model\.mlp_only_layers: is a Qwen3-MoE setting, which a qwen3 model"),
    (dict(num_hidden_layers=2, first_k_dense_replace=1, head_dim=64),
     r"^model\.head_dim: is a DeepSeek-V4 / Qwen3 / Qwen3-MoE setting, which a deepseek_v3 model does not read"),
    (dict(QWEN3, num_key_value_heads=3), r"^model\.num_key_value_heads: 3 must divide num_attention_heads \(4\)"),
    (dict(QWEN3, head_dim=15), r"^model\.head_dim: must be even"),
    (dict(MOE, mlp_only_layers=[4]), r"^model\.mlp_only_layers\[0\]: must be a layer id in 0\.\.3"),
    (dict(MOE, num_experts_per_tok=9), r"^model\.num_experts_per_tok: 9 exceeds n_routed_experts \(8\)"),
    (dict(QWEN3, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"^model\.rope_scaling\.type: only 'linear'"),
    (dict(QWEN3, rope_scaling={"rope_type": "linear"}), r"^model\.rope_scaling\.factor: must be > 0 for linear"),
    (dict(QWEN3, architectures="Qwen3MoeForCausalLM"), r"^model\.architectures: must be 'Qwen3ForCausalLM'"),
    (dict(QWEN3, attention_dropout=1.5), r"^model\.attention_dropout: must be a probability in \[0, 1\)"),
])
def test_validation_per_family(section, error):
    with pytest.raises(ConfigError, match=error):
        _model(section)


def test_qwen3_validates_and_rope_kinds():
    _model(QWEN3)
    _model(dict(MOE, decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True))
    for rope in ({"type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 16}):
        _model(dict(QWEN3, rope_scaling=rope))
    no_kv = {k: v for k, v in QWEN3.items() if k != "num_key_value_heads"}
    assert _model(no_kv).num_key_value_heads == 4  # HF / MindFormers: as many as the query heads


def test_mindformers_style_round_trips():
    section = dict(MOE, decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True, router_aux_loss_coef=0.02,
                   output_router_logits=True, param_init_dtype="float32", hidden_act="silu")
    mf = to_mindformers(to_canonical(section))
    assert mf["head_dim"] == 16  # MindFormers' Qwen3 configs keep HF's structure names
    assert mf["untie_embeddings_and_output_weights"] is False and mf["num_experts"] == 8
    assert mf["moe_aux_loss_coeff"] == 0.02 and mf["params_dtype"] == "float32"
    assert mf["moe_router_score_function"] == "softmax" and mf["multi_latent_attention"] is False
    assert _model(mf) == _model(section)
    quiet = dict(section, output_router_logits=False)
    assert _model(to_mindformers(to_canonical(quiet))) == _model(quiet)


def test_plan_by_hand():
    c = ModelConfig(**dict(MOE, decoder_sparse_step=2, mlp_only_layers=[3], attention_bias=True))
    h, v, n, kv, d = 32, 64, 4, 2, 16
    attention = (h + 1) * (n + 2 * kv) * d + (n * d + 1) * h + 2 * d
    dense, expert = 3 * h * 48, 3 * h * 16
    total = 2 * v * h + h + 4 * (attention + 2 * h) + 3 * dense + 8 * h + 8 * expert
    active = total - 6 * expert
    assert count_parameters(c) == (total, active)
    matmul = active - v * h - h - 4 * (2 * h + 2 * d)
    assert flops_per_token(c) == 6 * matmul + 6 * n * 16 * 2 * d * 4
    specs = {p.name: p for p in param_specs(c)}
    assert specs["model.layers.1.mlp.experts.gate_proj"].shape == (8, 16, 32)
    assert "model.layers.0.mlp.gate_proj.weight" in specs and "model.layers.3.mlp.gate_proj.weight" in specs
    assert tp_split("model.layers.0.self_attn.k_proj.weight") == ("column", 0)
    assert tp_split("model.layers.0.self_attn.v_proj.bias") == ("column", 0)
    assert tp_split("model.layers.0.self_attn.q_norm.weight") == ("replicated", None)
    tied = ModelConfig(**dict(QWEN3, tie_word_embeddings=True))
    assert "lm_head.weight" not in {p.name for p in param_specs(tied)}
    untied = ModelConfig(**QWEN3)
    assert count_parameters(untied)[0] - count_parameters(tied)[0] == v * h
    assert flops_per_token(untied) == flops_per_token(tied)  # the head's matmul either way


def test_qwen3_moe_under_pipeline_parallelism_is_accepted():
    """HF's balance is one product over every MoE layer's tokens: the stages pass the layers'
    balance terms along (integration_tests/test_qwen3_layouts.py runs it)."""
    from mindtrain.config import ParallelismConfig
    from mindtrain.config.validate import validate_parallelism

    validate_parallelism(ParallelismConfig(pipeline_parallel=2), ModelConfig(**MOE))
    validate_parallelism(ParallelismConfig(pipeline_parallel=2), ModelConfig(**QWEN3))
    validate_parallelism(ParallelismConfig(pipeline_parallel=2), ModelConfig(**QWEN3))
    validate_parallelism(ParallelismConfig(tensor_parallel=2, context_parallel=2, expert_parallel=2),
                         ModelConfig(**MOE))
