"""The model families one flat :class:`~mindtrain.config.schema.ModelConfig` describes, and
what each reads of it. Pure Python (no MindSpore).

``MODEL_TYPES`` maps each ``model_type`` to its one architecture. ``FAMILY_FIELDS`` lists the
fields a family reads; the schema's defaults are DeepSeek-V3's, and a field a family does not
read must keep its default (:func:`unread_fields`, which validation turns into a one-line
error), so that a setting never silently does nothing. :func:`moe_layer_ids` and
:func:`head_dim` are each family's layer and head rules, written once for the parameter plan
(:mod:`mindtrain.config.model_plan`), validation and the models package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mindtrain.config.schema import ModelConfig

MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""model_type -> the architecture (model class) it must name."""
FAMILY_NAMES = {"deepseek_v3": "DeepSeek-V3", "deepseek_v4": "DeepSeek-V4", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE"}
QWEN3_FAMILIES = ("qwen3", "qwen3_moe")

# MindFormers-only switches (kernels, dtypes of parts of the compute; start-up notes on CPU)
_SWITCHES = ("use_flash_attention", "bias_swiglu_fusion", "apply_rope_fusion", "use_attn_mask_compression",
             "layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype", "hidden_dropout")
_COMMON = ("model_type", "architectures", "seq_length", "vocab_size", "hidden_size", "intermediate_size",
           "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "qk_layernorm", "hidden_act",
           "max_position_embeddings", "initializer_range", "rms_norm_eps", "rope_theta", "rope_scaling",
           "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "compute_dtype",
           "param_init_dtype") + _SWITCHES
_MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_dense_type",
        "moe_grouped_gemm", "use_fused_ops_topkrouter", "moe_token_drop_policy", "use_pad_tokens")
_DEEPSEEK = ("n_shared_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
             "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "first_k_dense_replace", "rope_interleave",
             "num_nextn_predict_layers", "mtp_loss_scaling_factor", "aux_loss_alpha", "bias_update_speed",
             "mla_qkv_concat")
_QWEN3 = ("head_dim", "tie_word_embeddings")
_DEEPSEEK_V4 = ("head_dim", "q_lora_rank", "qk_rope_head_dim", "n_shared_experts", "routed_scaling_factor",
                "bias_update_speed", "compress_ratios", "compress_rope_theta", "sliding_window", "o_groups",
                "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
                "hc_eps", "num_hash_layers", "scoring_func", "swiglu_limit", "experimental_attention_variant",
                "enable_hyper_connections", "enable_hc_head", "num_nextn_predict_layers", "mtp_loss_scaling_factor",
                # the mla variant's attention (DeepSeek-V3's)
                "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "mla_qkv_concat",
                "aux_loss_alpha",  # MindFormers' seq_aux_loss (HF's config.json: 0)
                "expert_dtype")
_V4_NOT_READ = ("intermediate_size", "norm_topk_prob")  # V4 has no dense MLP; its routing weights are always normalised
_QWEN3_MOE = ("decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")

FAMILY_FIELDS: dict[str, frozenset[str]] = {
    "deepseek_v3": frozenset(_COMMON + _MOE + _DEEPSEEK),
    "deepseek_v4": frozenset(_COMMON + _MOE + _DEEPSEEK_V4) - frozenset(_V4_NOT_READ),
    "qwen3": frozenset(_COMMON + _QWEN3),
    "qwen3_moe": frozenset(_COMMON + _QWEN3 + _MOE + _QWEN3_MOE),
}
"""The ModelConfig fields each family reads."""


def family_fields(model_type: str) -> frozenset[str]:
    """The fields ``model_type`` reads (every field for an unknown type, which validation refuses)."""
    return FAMILY_FIELDS.get(model_type, frozenset(f.name for f in dataclasses.fields(ModelConfig)))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def unread_fields(m: ModelConfig) -> list[tuple[str, str]]:
    """``(field, family that reads it)`` for every field ``m``'s family does not read whose
    value is not the schema default, in schema order."""
    reads = family_fields(m.model_type)
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in reads or getattr(m, f.name) == _default(f):
            continue
        owners = [FAMILY_NAMES[t] for t, names in FAMILY_FIELDS.items() if f.name in names]
        out.append((f.name, " / ".join(owners) or "no model"))
    return out


def head_dim(m: ModelConfig) -> int:
    """Qwen3's size of each query, key and value head: ``head_dim``, or hidden_size //
    num_attention_heads when it is null."""
    return int(m.head_dim) if m.head_dim else m.hidden_size // m.num_attention_heads


def moe_layer_ids(m: ModelConfig) -> list[int]:
    """The model layers (decoder layers, then DeepSeek-V3's MTP modules) whose feed-forward
    block is a mixture of experts. DeepSeek-V3: from ``first_k_dense_replace`` on, MTP
    included. Qwen3-MoE (HF's rule): layer i when ``(i + 1) % decoder_sparse_step == 0``, it
    is not in ``mlp_only_layers`` and there are experts. DeepSeek-V4: every layer (hash-routed
    or learned). Qwen3: none."""
    n = m.num_hidden_layers
    if m.model_type == "deepseek_v3":
        return list(range(m.first_k_dense_replace, n + m.num_nextn_predict_layers))
    if m.model_type == "deepseek_v4":
        return list(range(n + m.num_nextn_predict_layers))
    if m.model_type != "qwen3_moe" or m.n_routed_experts <= 0:
        return []
    step = max(int(m.decoder_sparse_step), 1)
    dense = set(m.mlp_only_layers or ())
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def v4_attention_kinds(m: ModelConfig) -> list[str]:
    """DeepSeek-V4's attention per decoder layer from ``compress_ratios``: ``sliding`` (0),
    ``csa`` (4: overlapping pooling and the lightning indexer) or ``hca`` (any other ratio)."""
    return ["sliding" if r == 0 else "csa" if r == 4 else "hca" for r in m.compress_ratios[:m.num_hidden_layers]]


def residual_streams(m: ModelConfig) -> int:
    """The residual's streams between layers: DeepSeek-V4's ``hc_mult`` hyper-connection streams
    ([B, S, N, H]), 1 ([B, S, H]) for every other model and for V4 without them
    (``enable_hyper_connections: false``: plain residual layers)."""
    return int(m.hc_mult) if m.model_type == "deepseek_v4" and m.enable_hyper_connections else 1


def has_moe(m: ModelConfig) -> bool:
    """Whether the model has any mixture-of-experts layer."""
    return bool(moe_layer_ids(m))


__all__ = ["FAMILY_FIELDS", "FAMILY_NAMES", "MODEL_TYPES", "QWEN3_FAMILIES", "family_fields", "has_moe", "head_dim",
           "moe_layer_ids", "residual_streams", "unread_fields", "v4_attention_kinds"]
