"""mindtrain's parameter names -> MindFormers' PyNative DeepSeek-V3 and Qwen3 / Qwen3-MoE names,
as plain Python (no numpy): the name table of :mod:`mindtrain.trainer.mindformers_names`
(which documents the map and adds how each tensor sits in MindFormers'), shared with the
rule of which parameters Muon updates (:mod:`mindtrain.trainer.muon_rules`), so the optimizer
and ``mindtrain-estimate`` match ``adamw_include`` globs against the same names.
"""

from __future__ import annotations

import re
from typing import Any

from mindtrain.config import UserError
from mindtrain.config.families import FAMILY_NAMES, QWEN3_FAMILIES

ROUTER = "mlp.router.weight"

# (mindtrain suffix inside a layer, MindFormers suffix, how mindtrain's tensor sits in MindFormers')
_NORMS = [
    ("input_layernorm.weight", "input_layernorm.weight", "same"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", "same"),
]
# the SwiGLU MLP (dense layers), the router and the routed experts: the same in both families
_MLP = [
    ("mlp.gate_proj.weight", "mlp.linear_fc1.weight", "gate"),
    ("mlp.up_proj.weight", "mlp.linear_fc1.weight", "up"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight", "same"),
]
_MOE = [
    ("mlp.gate.weight", ROUTER, "same"),
    ("mlp.experts.gate_proj", "mlp.experts.weight1", "gate_t"),
    ("mlp.experts.up_proj", "mlp.experts.weight1", "up_t"),
    ("mlp.experts.down_proj", "mlp.experts.weight2", "t"),
]
_LAYER = _NORMS + [
    ("self_attn.q_a_proj.weight", "self_attention.linear_qkv.weight", "q"),  # with q_lora_rank
    ("self_attn.q_proj.weight", "self_attention.linear_qkv.weight", "q"),  # without
    ("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_qkv.weight", "kv"),
    ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight", "same"),
    ("self_attn.q_b_proj.weight", "self_attention.linear_qb.weight", "same"),
    ("self_attn.kv_a_layernorm.weight", "self_attention.k_layernorm.weight", "same"),
    ("self_attn.kv_b_proj.weight", "self_attention.linear_kvb.weight", "same"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", "same"),
] + _MLP + [
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.linear_fc1.weight", "gate"),
    ("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight", "up"),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", "same"),
    ("mlp.gate.e_score_correction_bias", "mlp.expert_bias", "same"),
] + _MOE
# Qwen3 / Qwen3-MoE (PyNativeQwen3ForCausalLM's GPTModel: SelfAttention with q/k layernorm,
# MLP, MoELayer without expert bias or shared experts); "gq" / "gk" / "gv": q/k/v rows in
# linear_qkv's per-query-group blocks
_QWEN3_LAYER = _NORMS + [
    ("self_attn.q_proj.weight", "self_attention.linear_qkv.weight", "gq"),
    ("self_attn.k_proj.weight", "self_attention.linear_qkv.weight", "gk"),
    ("self_attn.v_proj.weight", "self_attention.linear_qkv.weight", "gv"),
    ("self_attn.q_proj.bias", "self_attention.linear_qkv.bias", "gq"),
    ("self_attn.k_proj.bias", "self_attention.linear_qkv.bias", "gk"),
    ("self_attn.v_proj.bias", "self_attention.linear_qkv.bias", "gv"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight", "same"),
    ("self_attn.o_proj.bias", "self_attention.linear_proj.bias", "same"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight", "same"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight", "same"),
] + _MLP + _MOE
_MTP = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
        ("eh_proj.weight", "eh_proj.weight"), ("shared_head.norm.weight", "final_layernorm.weight")]
_TOP = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("model.norm.weight", "decoder.final_layernorm.weight"), ("lm_head.weight", "output_layer.weight")]
TOP_NAMES = dict(_TOP)
"""MindFormers' names of the top-level weights, by mindtrain's."""
_OURS_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_THEIRS_LAYER = re.compile(r"^(decoder\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)$")


def is_qwen3(cfg: Any) -> bool:
    """Whether the model config is of the Qwen3 family (model_type qwen3 / qwen3_moe)."""
    return getattr(cfg, "model_type", "deepseek_v3") in QWEN3_FAMILIES


def _family(cfg: Any) -> str:
    return FAMILY_NAMES.get(getattr(cfg, "model_type", "deepseek_v3"), "DeepSeek-V3")


def _layer_map(cfg: Any) -> list[tuple[str, str, str]]:
    return _QWEN3_LAYER if is_qwen3(cfg) else _LAYER


def _prefix(index: int, cfg) -> tuple[str, bool]:
    """MindFormers' prefix of mindtrain's layer ``index``, and whether it is an MTP module."""
    if index >= cfg.num_hidden_layers:
        return f"mtp.layers.{index - cfg.num_hidden_layers}.", True
    return f"decoder.layers.{index}.", False


def locate(name: str, cfg: Any) -> tuple[str, str]:
    """MindFormers' name of the tensor holding mindtrain's parameter ``name`` and how the
    parameter sits in it (the ``how`` of :data:`_LAYER`: "same", "q", "gate_t", ...); a name
    this map does not know is a UserError."""
    if getattr(cfg, "model_type", "deepseek_v3") == "deepseek_v4":
        # MindFormers' PyNative V4 (GPTModel with its dsv4 attention variants) is not mapped:
        # DeepSeek-V3's table would give wrong names for V4's same-named weights
        raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}' "
                        "(DeepSeek-V4's MindFormers names are not mapped yet; use layout: mindtrain)")
    if name in TOP_NAMES:
        return TOP_NAMES[name], "same"
    m = _OURS_LAYER.match(name)
    if m:
        prefix, mtp = _prefix(int(m.group(1)), cfg)
        part = m.group(2)
        if mtp and is_qwen3(cfg):
            raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}' "
                            f"({_family(cfg)} has {cfg.num_hidden_layers} layers)")
        if mtp:
            for ours, theirs in _MTP:
                if part == ours:
                    return prefix + theirs, "same"
            prefix += "transformer_layer."
        for ours, theirs, how in _layer_map(cfg):
            if part == ours:
                return prefix + theirs, how
    raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}'")


__all__ = ["ROUTER", "TOP_NAMES", "is_qwen3", "locate"]
