"""The parameter plan of a DeepSeek-V3 config, its counts and FLOPs, its units' pipeline
partition and the row-block rule (the models package checks the plan against the built model)."""

import pytest

from mindtrain.config import ConfigError, ModelConfig
from mindtrain.config.model_plan import count_parameters, flops_per_token, param_specs, tp_split, unit_of, units
from mindtrain.config.pipeline import partition_units
from mindtrain.config.recompute import core_in_row_blocks

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
             num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
             qk_nope_head_dim=8, v_head_dim=8, seq_length=16, max_position_embeddings=64, num_nextn_predict_layers=1)


def _by_hand(c: ModelConfig) -> tuple[int, int, float]:
    """(total, active, FLOPs per token) of ``c`` in closed form, layer by layer."""
    h, v, n = c.hidden_size, c.vocab_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    b = 1 if c.attention_bias else 0
    q = (h * c.q_lora_rank + b * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * qk) if c.q_lora_rank \
        else h * n * qk
    kv = (h + b) * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank \
        + c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
    attention = q + kv + n * c.v_head_dim * h + b * h
    norms = 2 * h + c.kv_lora_rank + (c.q_lora_rank or 0)  # per layer: input, post-attention, kv_a, q_a
    total = active = 2 * v * h + h
    matmul = v * h * (1 + c.num_nextn_predict_layers)  # lm_head once per prediction depth
    layers = c.num_hidden_layers + c.num_nextn_predict_layers
    for i in range(layers):
        if i < c.first_k_dense_replace:
            t = a = attention + 2 * h + 3 * h * c.intermediate_size
        else:
            expert = 3 * h * c.moe_intermediate_size
            base = attention + 2 * h + c.n_routed_experts * h + expert * c.n_shared_experts
            t, a = base + expert * c.n_routed_experts, base + expert * c.num_experts_per_tok
        matmul += a - norms
        if i >= c.num_hidden_layers:  # enorm, hnorm, shared_head.norm; eh_proj is a matmul
            t, a, matmul = t + 3 * h + 2 * h * h, a + 3 * h + 2 * h * h, matmul + 2 * h * h
        total, active = total + t, active + a
    flops = 6 * matmul + 6 * n * c.seq_length * (qk + c.v_head_dim) * layers
    return total, active, float(flops)


@pytest.mark.parametrize("extra", [{}, dict(q_lora_rank=None, attention_bias=True, first_k_dense_replace=0,
                                            n_shared_experts=2, num_nextn_predict_layers=0),
                                   dict(num_nextn_predict_layers=2, n_shared_experts=0)])
def test_counts_and_flops_by_hand(extra):
    c = ModelConfig(**dict(SMALL, **extra))
    total, active, flops = _by_hand(c)
    assert count_parameters(c) == (total, active)
    assert flops_per_token(c) == flops
    assert flops_per_token(c, 64) > flops  # the attention term follows the sequence


def test_specs_split_and_units():
    c = ModelConfig(**SMALL)
    specs = {p.name: p for p in param_specs(c)}
    assert specs["model.layers.1.mlp.experts.up_proj"].shape == (4, 16, 32)
    assert (specs["model.layers.1.mlp.experts.up_proj"].tp, specs["model.layers.1.mlp.experts.up_proj"].tp_dim,
            specs["model.layers.1.mlp.experts.up_proj"].expert) == ("column", 1, True)
    assert tp_split("model.layers.0.self_attn.o_proj.weight") == ("row", 1)
    assert tp_split("model.layers.0.self_attn.q_a_proj.weight") == ("replicated", None)
    assert unit_of("model.layers.3.eh_proj.weight", 3) == "mtp.0" and unit_of("lm_head.weight", 3) == "head"
    assert [u.name for u in units(c)] == ["embedding", "layers.0", "layers.1", "layers.2", "head", "mtp.0"]
    assert units(c)[4].params == ["model.norm.weight", "lm_head.weight"]


def test_partition_of_the_model_units():
    c = ModelConfig(**dict(SMALL, num_hidden_layers=8))
    assert partition_units(units(c), 2) == [["embedding"] + [f"layers.{i}" for i in range(4)],
                                            [f"layers.{i}" for i in range(4, 8)] + ["head", "mtp.0"]]
    # 2 stages x 2 chunks: chunk c of rank r is virtual stage c x 2 + r
    assert partition_units(units(c), 2, ["0-1,4-5", "2-3,6-7"], chunks=2) == [
        ["embedding", "layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4", "layers.5"],
        ["layers.6", "layers.7", "head", "mtp.0"]]
    assert partition_units(units(c), 3) == [["embedding", "layers.0", "layers.1", "layers.2"],
                                            ["layers.3", "layers.4", "layers.5"], ["layers.6", "layers.7", "head",
                                                                                   "mtp.0"]]
    with pytest.raises(ConfigError, match="pipeline_parallel_layers_per_stage"):
        partition_units(units(c), 2, [3, 3])


def test_row_block_rule():
    assert core_in_row_blocks(False, 1, 16)  # eager: always
    assert not core_in_row_blocks(True, 8, 512)  # compiled, 8 x 512 x 512 = 2M scores: the graph keeps them
    assert core_in_row_blocks(True, 8, 1024)  # 8M scores: more than a block
    assert core_in_row_blocks(True, 2, 16, block=64) and not core_in_row_blocks(True, 2, 16, block=512)
