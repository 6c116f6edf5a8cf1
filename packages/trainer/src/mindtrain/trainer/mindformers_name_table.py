"""mindtrain's parameter names -> MindFormers' PyNative DeepSeek-V3, DeepSeek-V4 and Qwen3 / Qwen3-MoE names,
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
# DeepSeek-V4 (MindFormers' PyNativeDeepseekV4ForCausalLM, models/deepseek4/utils.py's
# weight_mapping / weight_converters and the GPTModel layer specs): the hybrid attention
# (dsv4_hybrid: DSv4HybridSelfAttention, CompressedSparseAttention, Compressor, CSAIndexer),
# or DeepSeek-V3's MLA (the mla variant: MLASelfAttention, the V3 names above); the MoE with
# the hash table; the hyper-connections (HyperConnectionModule: mapping_proj, bias, and the
# three scales alpha_pre / alpha_post / alpha_res that mindtrain keeps as one [3] tensor, "scale")
_CORE = "self_attention.core_attention."
_V4_POOL = [("position_bias", "ape", "same"), ("kv_proj.weight", "linear_wkv.weight", "same"),
            ("gate_proj.weight", "linear_wgate.weight", "same"), ("kv_norm.weight", "norm.weight", "same")]
_V4_HYBRID_ATTENTION = [
    ("self_attn.sinks", _CORE + "attn_sink", "same"),
    ("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight", "same"),
    ("self_attn.q_a_norm.weight", "self_attention.q_layernorm.weight", "same"),
    ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight", "same"),
    ("self_attn.kv_proj.weight", "self_attention.linear_kv_proj.weight", "same"),
    ("self_attn.kv_norm.weight", "self_attention.kv_layernorm.weight", "same"),
    ("self_attn.o_a_proj.weight", "self_attention.linear_o_group_proj", "same"),
    ("self_attn.o_b_proj.weight", "self_attention.linear_proj.weight", "same"),
] + [("self_attn.compressor." + o, _CORE + "compressor." + t, h) for o, t, h in _V4_POOL] + [
    ("self_attn.compressor.indexer." + o, _CORE + "indexer.compressor." + t, h) for o, t, h in _V4_POOL] + [
    ("self_attn.compressor.indexer.q_b_proj.weight", _CORE + "indexer.linear_wq_b.weight", "same"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", _CORE + "indexer.linear_weights_proj.weight", "same"),
]
_V4_REST = _NORMS + [
    ("mlp.gate.tid2eid", "mlp.router.tid2eid", "int32"),  # MindFormers' table is int32 [V, K]; mindtrain's float ids
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.linear_fc1.weight", "gate"),
    ("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight", "up"),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", "same"),
    ("mlp.gate.e_score_correction_bias", "mlp.expert_bias", "same"),
] + _MOE + [(f"{hc}.{o}", f"{hc}.{t}", h) for hc in ("attn_hc", "ffn_hc")
            for o, t, h in (("fn", "mapping_proj.weight", "same"), ("base", "bias", "same"),
                            ("scale", "alpha_pre", "split:0:3"), ("scale", "alpha_post", "split:1:3"),
                            ("scale", "alpha_res", "split:2:3"))]
INTEGER_TENSORS = tuple(t for _, t, how in _V4_REST if how == "int32")
"""Suffixes of the MindFormers tensors stored as integers (V4's hash tables)."""
V4_SCALES = ("alpha_pre", "alpha_post", "alpha_res")
"""MindFormers' three tensors [1] of a hyper-connection's ``scale`` [3], in order
(pynative/transformers/hyper_connection.py ``HyperConnectionModule``; "split:k:n": part k of n
equal parts along axis 0)."""
_V4_HEAD = [("hc_head.hc_fn", "hc_head.hc_fn.weight"), ("hc_head.hc_base", "hc_head.hc_base"),
            ("hc_head.hc_scale", "hc_head.hc_scale")]
_MTP = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
        ("eh_proj.weight", "eh_proj.weight"), ("shared_head.norm.weight", "final_layernorm.weight")]
_TOP = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("model.norm.weight", "decoder.final_layernorm.weight"), ("lm_head.weight", "output_layer.weight")]
TOP_NAMES = dict(_TOP)
"""MindFormers' names of the top-level weights, by mindtrain's."""
# MindFormers' parameters that mindtrain has no counterpart of: constants its modules keep as
# parameters without a gradient, which its saves write. Per family: (the MindFormers tensor of
# the same module that sizes it, that tensor's axes the constant spans, the constant's name, its
# value). Written beside their tensor's boxes, dropped on read.
TOKENS_PER_EXPERT = "mlp.tokens_per_expert"  # MoELayer's token count (zeroed after each step)
_COMPANIONS = {
    "deepseek_v3": [("mlp.expert_bias", (0,), TOKENS_PER_EXPERT, 0.0)],
    "qwen3": [(ROUTER, (0,), TOKENS_PER_EXPERT, 0.0)],  # Qwen3-MoE: no expert bias
    # every V4 MoE layer has one (hash-routed layers have no expert bias); HyperConnectionModule's
    # fixed RMSNorm gamma [n*H]; DSv4HybridSelfAttention's fixed query RMSNorm gamma
    # [q_head_dim], which MindFormers sets to v_head_dim (linear_kv_proj's rows, there under
    # qk_layernorm: false too, unlike kv_layernorm; the mla variant has none)
    "deepseek_v4": [(ROUTER, (0,), TOKENS_PER_EXPERT, 0.0),
                    ("attn_hc.mapping_proj.weight", (1,), "attn_hc.rms_weight", 1.0),
                    ("ffn_hc.mapping_proj.weight", (1,), "ffn_hc.rms_weight", 1.0),
                    ("self_attention.linear_kv_proj.weight", (0,), "self_attention.q_rms_gamma", 1.0)],
}


def companions(cfg: Any) -> list[tuple[str, tuple[int, ...], str, float]]:
    """MindFormers' constant parameters of the family of model config ``cfg`` that mindtrain
    has none of: (sizing tensor's suffix, its axes, the constant's suffix, its value)."""
    family = getattr(cfg, "model_type", "deepseek_v3")
    return _COMPANIONS["qwen3" if is_qwen3(cfg) else family if family in _COMPANIONS else "deepseek_v3"]


_OURS_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_THEIRS_LAYER = re.compile(r"^(decoder\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)$")


def is_qwen3(cfg: Any) -> bool:
    """Whether the model config is of the Qwen3 family (model_type qwen3 / qwen3_moe)."""
    return getattr(cfg, "model_type", "deepseek_v3") in QWEN3_FAMILIES


def _family(cfg: Any) -> str:
    return FAMILY_NAMES.get(getattr(cfg, "model_type", "deepseek_v3"), "DeepSeek-V3")


def _layer_map(cfg: Any) -> list[tuple[str, str, str]]:
    if getattr(cfg, "model_type", "deepseek_v3") == "deepseek_v4":
        if cfg.experimental_attention_variant == "mla":
            return [e for e in _LAYER if e[0].startswith("self_attn.")] + _V4_REST
        return _V4_HYBRID_ATTENTION + _V4_REST
    return _QWEN3_LAYER if is_qwen3(cfg) else _LAYER


def _prefix(index: int, cfg) -> tuple[str, bool]:
    """MindFormers' prefix of mindtrain's layer ``index``, and whether it is an MTP module."""
    if index >= cfg.num_hidden_layers:
        return f"mtp.layers.{index - cfg.num_hidden_layers}.", True
    return f"decoder.layers.{index}.", False


ADAPTERS = (".lora_a", ".lora_b")
"""LoRA's adapters of a Linear layer's ``<layer>.weight``: ``<layer>.lora_a`` [r, in] and
``<layer>.lora_b`` [out, r], in both layouts (MindFormers' ``LinearWithLoRA`` names)."""
FUSED_FIRST = ("q", "gq", "gate")
"""The ``how`` of the first part of a weight MindFormers fuses (``linear_qkv``: "q" then "kv", or
Qwen3's "gq", "gk", "gv"; ``linear_fc1``: "gate" then "up"): the part that holds the fused
layer's one ``lora_a`` (mindtrain.models.lora)."""


def fused_first(how: str) -> bool:
    """Whether a weight placed by ``how`` holds its MindFormers layer's ``lora_a``: an unfused
    weight, or the first part of a fused one."""
    return how in FUSED_FIRST or how in ("same",)


def _adapter_of(name: str) -> tuple[str, str]:
    """(the weight of adapter ``name``, its suffix)."""
    layer, suffix = name.rsplit(".", 1)
    return layer + ".weight", "." + suffix


def locate_all(name: str, cfg: Any) -> list[tuple[str, str]]:
    """Every MindFormers tensor holding a part of mindtrain's parameter ``name``, and how the
    part sits in it (the ``how`` of :data:`_LAYER`: "same", "q", "gate_t", ..., "split:k:n"
    for part k of n along axis 0, "int32" for a table MindFormers keeps as int32): one, or
    several (a DeepSeek-V4 hyper-connection ``scale`` [3] is :data:`V4_SCALES`); a name this
    map does not know is a UserError. A LoRA adapter (:data:`ADAPTERS`) sits in its layer's
    adapter: ``lora_b``'s rows as the weight's rows (a part of ``linear_qkv.lora_b``), ``lora_a``
    whole (the one of a fused layer, which only its first part holds)."""
    if name.endswith(ADAPTERS):
        weight, suffix = _adapter_of(name)
        found = locate_all(weight, cfg)
        if len(found) != 1 or not found[0][0].endswith(".weight"):
            raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}'")
        theirs, how = found[0]
        if suffix == ".lora_a" and not fused_first(how):
            raise UserError(f"checkpoint.layout: mindformers: '{name}': a fused layer's later part has no lora_a "
                            "of its own (it shares the first part's)")
        return [(theirs[:-len(".weight")] + suffix, how if suffix == ".lora_b" else "same")]
    v4 = getattr(cfg, "model_type", "deepseek_v3") == "deepseek_v4"
    if name in TOP_NAMES:
        return [(TOP_NAMES[name], "same")]
    if v4 and name.startswith("model.hc_head."):
        for ours, theirs in _V4_HEAD:
            if name == "model." + ours:
                return [("decoder." + theirs, "same")]
    m = _OURS_LAYER.match(name)
    if m:
        prefix, mtp = _prefix(int(m.group(1)), cfg)
        part = m.group(2)
        if mtp and is_qwen3(cfg):
            raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}' "
                            f"({_family(cfg)} has {cfg.num_hidden_layers} layers)")
        if mtp:
            for ours, theirs in _MTP + (_V4_HEAD if v4 else []):
                if part == ours:
                    return [(prefix + theirs, "same")]
            prefix += "transformer_layer."
        found = [(prefix + theirs, how) for ours, theirs, how in _layer_map(cfg) if part == ours]
        if found:
            return found
    raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}'")


def locate(name: str, cfg: Any) -> tuple[str, str]:
    """The first of :func:`locate_all`: MindFormers' name of the tensor holding (the first part
    of) mindtrain's parameter ``name``, and how it sits there."""
    return locate_all(name, cfg)[0]


def mindformers_names_of(name: str, cfg: Any) -> list[str]:
    """Every MindFormers tensor mindtrain's parameter ``name`` is stored in: one, or for a
    DeepSeek-V4 hyper-connection ``scale`` [3] its three scalars (:data:`V4_SCALES`)."""
    return [theirs for theirs, _ in locate_all(name, cfg)]


__all__ = ["ADAPTERS", "FUSED_FIRST", "INTEGER_TENSORS", "fused_first", "ROUTER", "TOKENS_PER_EXPERT", "TOP_NAMES", "V4_SCALES", "companions", "is_qwen3", "locate",
           "locate_all", "mindformers_names_of"]
