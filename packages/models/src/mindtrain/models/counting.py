"""Parameter and FLOP counts from a ModelConfig alone (no model needed)."""

from __future__ import annotations

from mindtrain.config import ModelConfig


def _attention_params(c: ModelConfig) -> int:
    n, h = c.num_attention_heads, c.hidden_size
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    bias = bool(c.attention_bias)
    if c.q_lora_rank:
        q = h * c.q_lora_rank + (c.q_lora_rank if bias else 0) + c.q_lora_rank + c.q_lora_rank * n * qk
    else:
        q = h * n * qk
    kv_a = h * (c.kv_lora_rank + c.qk_rope_head_dim) + ((c.kv_lora_rank + c.qk_rope_head_dim) if bias else 0)
    kv = kv_a + c.kv_lora_rank + c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
    o = n * c.v_head_dim * h + (h if bias else 0)
    return q + kv + o


def _layer_params(c: ModelConfig, idx: int) -> tuple[int, int]:
    """(total, active) of decoder layer ``idx`` (MTP modules use idx >= num_hidden_layers)."""
    h = c.hidden_size
    base = _attention_params(c) + 2 * h
    if idx < c.first_k_dense_replace:
        mlp = 3 * h * c.intermediate_size
        return base + mlp, base + mlp
    expert = 3 * h * c.moe_intermediate_size
    router = c.n_routed_experts * h
    shared = expert * c.n_shared_experts
    total = base + router + shared + expert * c.n_routed_experts
    active = base + router + shared + expert * c.num_experts_per_tok
    return total, active


def count_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) trainable parameters, MTP modules included; the expert-bias
    buffers are not counted."""
    h, v = cfg.hidden_size, cfg.vocab_size
    total = active = 2 * v * h + h  # embedding, lm_head, final norm
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        t, a = _layer_params(cfg, i)
        if i >= cfg.num_hidden_layers:  # MTP extras: enorm, hnorm, eh_proj, shared_head.norm
            t += 3 * h + 2 * h * h
            a += 3 * h + 2 * h * h
        total += t
        active += a
    return total, active


def flops_per_token(cfg: ModelConfig, seq_length: int | None = None) -> float:
    """Training FLOPs per token: 6 x the matmul parameters a token uses (embedding lookup and
    norms excluded, lm_head counted once per prediction depth) + the attention term
    6 x heads x S x (qk_head_dim + v_head_dim) per layer (full S, the PaLM convention)."""
    s = seq_length or cfg.seq_length
    h, v = cfg.hidden_size, cfg.vocab_size
    n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    matmul = v * h * (1 + cfg.num_nextn_predict_layers)
    for i in range(n_layers):
        _, a = _layer_params(cfg, i)
        norms = 2 * h + cfg.kv_lora_rank + (cfg.q_lora_rank or 0)
        matmul += a - norms
        if i >= cfg.num_hidden_layers:
            matmul += 2 * h * h
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = 6 * cfg.num_attention_heads * s * (qk + cfg.v_head_dim) * n_layers
    return float(6 * matmul + attention)
