"""mindtrain's parameter names <-> MindFormers' PyNative DeepSeek-V3 names (numpy only).

mindtrain names its parameters as Hugging Face does, with routed experts stacked
(``model.layers.N.mlp.experts.gate_proj [E, I, H]``). MindFormers'
``PyNativeDeepseekV3ForCausalLM`` (``auto_prefix=False`` around a ``GPTModel``) names them in
Megatron style, with fused tensors::

    mindtrain (network)                                 MindFormers PyNative
    model.embed_tokens.weight                           embedding.word_embeddings.weight
    model.layers.N.input_layernorm.weight               decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.q_a_proj.weight  [q, H]  \\
    model.layers.N.self_attn.kv_a_proj_with_mqa.weight  > decoder.layers.N.self_attention.linear_qkv.weight
                                         [c + r, H]   /    [q + c + r, H]   (rows concatenated)
    ...self_attn.q_a_layernorm / kv_a_layernorm         ...self_attention.q_layernorm / k_layernorm
    ...self_attn.q_b_proj / kv_b_proj / o_proj          ...self_attention.linear_qb / linear_kvb / linear_proj
    model.layers.N.post_attention_layernorm.weight      decoder.layers.N.pre_mlp_layernorm.weight
    ...mlp.gate_proj + mlp.up_proj  [I, H] each         ...mlp.linear_fc1.weight [2I, H], rows interleaved
                                                           g0, u0, g1, u1, ... (dense and shared experts)
    ...mlp.down_proj                                    ...mlp.linear_fc2.weight
    ...mlp.gate.weight [E, H]                           ...mlp.router.weight
    ...mlp.gate.e_score_correction_bias [E]             ...mlp.expert_bias
    (none)                                              ...mlp.tokens_per_expert [E] (a buffer, zeros)
    ...mlp.experts.gate_proj + up_proj [E, I, H]        ...mlp.experts.weight1 [E, H, 2I] = [gate^T | up^T]
    ...mlp.experts.down_proj [E, H, I]                  ...mlp.experts.weight2 [E, I, H] = down^T
    model.norm.weight                                   decoder.final_layernorm.weight
    lm_head.weight                                      output_layer.weight
    model.layers.{L+k}.enorm / hnorm / eh_proj          mtp.layers.k.enorm / hnorm / eh_proj
    model.layers.{L+k}.shared_head.norm                 mtp.layers.k.final_layernorm
    model.layers.{L+k}.<layer part>                     mtp.layers.k.transformer_layer.<layer part>

Every transform only moves values, so the AdamW moments of a parameter map exactly as the
parameter does. Sizes come from the model config (``mindtrain.config.ModelConfig``).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from mindtrain.config import UserError

# MindFormers' MoE layer keeps a per-expert token count as a parameter (no gradient); mindtrain
# has none. It is written as zeros (MindFormers zeroes it after each step) and dropped on read.
TOKENS_PER_EXPERT = "tokens_per_expert"

_RENAMES = [  # (mindtrain suffix inside a layer, MindFormers suffix), one to one
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
    ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.q_b_proj.weight", "self_attention.linear_qb.weight"),
    ("self_attn.kv_a_layernorm.weight", "self_attention.k_layernorm.weight"),
    ("self_attn.kv_b_proj.weight", "self_attention.linear_kvb.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight"),
    ("mlp.gate.weight", "mlp.router.weight"),
    ("mlp.gate.e_score_correction_bias", "mlp.expert_bias"),
]
_MTP_RENAMES = [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                ("eh_proj.weight", "eh_proj.weight"), ("shared_head.norm.weight", "final_layernorm.weight")]
_TOP = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("model.norm.weight", "decoder.final_layernorm.weight"), ("lm_head.weight", "output_layer.weight")]
_OURS_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_THEIRS_LAYER = re.compile(r"^(decoder\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)$")


def uses_mindformers_names(names) -> bool:
    """Whether tensor names are MindFormers' (a checkpoint MindFormers wrote, or mindtrain
    with this map) rather than mindtrain's own (mindtrain before the map)."""
    return any(n.startswith(("decoder.", "embedding.", "output_layer.", "mtp.")) for n in names)


def _q_rows(cfg) -> int:
    """Rows of linear_qkv that are the query part: q_lora_rank, or the full query projection."""
    if cfg.q_lora_rank:
        return cfg.q_lora_rank
    return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _top_and_layers(tensors: dict[str, np.ndarray], top: dict[str, str], layer: Any, unknown: Any
                    ) -> tuple[dict[str, np.ndarray], list]:
    """Both directions' first pass: the top-level tensors renamed by ``top``, and
    ``(name, match, array)`` for every other name, which must match the ``layer`` regex (else
    ``unknown(name)`` is the UserError's text)."""
    out: dict[str, np.ndarray] = {}
    layers = []
    for name, a in tensors.items():
        if name in top:
            out[top[name]] = a
            continue
        m = layer.match(name)
        if not m:
            raise UserError(unknown(name))
        layers.append((name, m, a))
    return out, layers


def to_mindformers(tensors: dict[str, np.ndarray], cfg: Any, buffers: bool = False) -> dict[str, np.ndarray]:
    """mindtrain-named arrays (network names, stacked experts) under MindFormers' PyNative
    names and layouts. ``buffers`` adds MindFormers' ``tokens_per_expert`` (model files only,
    not moments). A name this map does not know is a UserError."""
    layer_parts: dict[str, dict[str, np.ndarray]] = {}
    out, layers = _top_and_layers(tensors, dict(_TOP), _OURS_LAYER,
                                  lambda name: f"checkpoint.layout: mindformers: no MindFormers name for parameter '{name}'")
    for name, m, a in layers:
        layer_parts.setdefault(m.group(1), {})[m.group(2)] = a
    for index, parts in layer_parts.items():
        i = int(index)
        if i >= cfg.num_hidden_layers:
            prefix = f"mtp.layers.{i - cfg.num_hidden_layers}."
            for ours, theirs in _MTP_RENAMES:
                if ours in parts:
                    out[prefix + theirs] = parts.pop(ours)
            prefix += "transformer_layer."
        else:
            prefix = f"decoder.layers.{i}."
        out.update(_layer_to_mindformers(parts, prefix, f"model.layers.{i}.", cfg, buffers))
    return out


def _layer_to_mindformers(parts: dict[str, np.ndarray], prefix: str, ours: str, cfg: Any,
                          buffers: bool) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    pairs = [("self_attn.q_a_proj.weight" if cfg.q_lora_rank else "self_attn.q_proj.weight",
              "self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_qkv.weight",
              lambda q, kv: np.concatenate([q, kv], axis=0)),
             ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.linear_fc1.weight", _interleave),
             ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
              "mlp.shared_experts.linear_fc1.weight", _interleave),
             ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.weight1",
              lambda g, u: np.concatenate([g.transpose(0, 2, 1), u.transpose(0, 2, 1)], axis=2))]
    for a, b, theirs, join in pairs:
        if a in parts or b in parts:
            if a not in parts or b not in parts:
                raise UserError(f"checkpoint.layout: mindformers: '{ours}{a if a not in parts else b}' is missing; "
                                f"MindFormers' {theirs} needs both of its parts")
            out[prefix + theirs] = np.ascontiguousarray(join(parts.pop(a), parts.pop(b)))
    if "mlp.experts.down_proj" in parts:
        out[prefix + "mlp.experts.weight2"] = np.ascontiguousarray(parts.pop("mlp.experts.down_proj").transpose(0, 2, 1))
    for o, t in _RENAMES:
        if o in parts:
            out[prefix + t] = parts.pop(o)
    if parts:
        raise UserError(f"checkpoint.layout: mindformers: no MindFormers name for parameter '{ours}{next(iter(parts))}'")
    if buffers and prefix + "mlp.router.weight" in out:
        out[prefix + "mlp." + TOKENS_PER_EXPERT] = np.zeros(cfg.n_routed_experts, np.float32)
    return out


def from_mindformers(tensors: dict[str, np.ndarray], cfg: Any) -> dict[str, np.ndarray]:
    """MindFormers-named arrays back under mindtrain's network names (the inverse of
    :func:`to_mindformers`; ``tokens_per_expert`` buffers are dropped)."""
    layer_parts: dict[str, dict[str, np.ndarray]] = {}
    out, layers = _top_and_layers(tensors, {t: o for o, t in _TOP}, _THEIRS_LAYER,
                                  lambda name: f"checkpoint.load_path: '{name}' is no parameter of MindFormers' "
                                               "DeepSeek-V3 that mindtrain knows; the checkpoint is of another model")
    for name, m, a in layers:
        if m.group(2) is not None:
            key = f"model.layers.{int(m.group(2))}."
        else:
            k = int(m.group(3))
            if k >= cfg.num_nextn_predict_layers:
                raise UserError(f"checkpoint.load_path: holds '{name}' but model.num_nextn_predict_layers is "
                                f"{cfg.num_nextn_predict_layers}; set it to the checkpoint's MTP depth")
            key = f"model.layers.{cfg.num_hidden_layers + k}."
            rest = m.group(4)
            mtp = {t: o for o, t in _MTP_RENAMES}
            if rest in mtp:
                out[key + mtp[rest]] = a
                continue
            if not rest.startswith("transformer_layer."):
                raise UserError(f"checkpoint.load_path: '{name}' is no part of a MindFormers MTP layer mindtrain knows")
            layer_parts.setdefault((key, m.group(1) + ".transformer_layer."), {})[rest[len("transformer_layer."):]] = a
            continue
        layer_parts.setdefault((key, m.group(1) + "."), {})[m.group(4)] = a
    for (key, theirs), parts in layer_parts.items():
        out.update(_layer_from_mindformers(parts, key, theirs, cfg))
    return out


def _layer_from_mindformers(parts: dict[str, np.ndarray], key: str, theirs_prefix: str, cfg: Any
                            ) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    parts.pop("mlp." + TOKENS_PER_EXPERT, None)
    if "self_attention.linear_qkv.weight" in parts:
        qkv = parts.pop("self_attention.linear_qkv.weight")
        q = _q_rows(cfg)
        out[key + ("self_attn.q_a_proj.weight" if cfg.q_lora_rank else "self_attn.q_proj.weight")] = qkv[:q]
        out[key + "self_attn.kv_a_proj_with_mqa.weight"] = qkv[q:]
    for theirs, mine in (("mlp.linear_fc1.weight", "mlp."), ("mlp.shared_experts.linear_fc1.weight",
                                                               "mlp.shared_experts.")):
        if theirs in parts:
            fc1 = parts.pop(theirs)
            out[key + mine + "gate_proj.weight"] = np.ascontiguousarray(fc1[0::2])
            out[key + mine + "up_proj.weight"] = np.ascontiguousarray(fc1[1::2])
    if "mlp.experts.weight1" in parts:
        w1 = parts.pop("mlp.experts.weight1")
        half = w1.shape[2] // 2
        out[key + "mlp.experts.gate_proj"] = np.ascontiguousarray(w1[:, :, :half].transpose(0, 2, 1))
        out[key + "mlp.experts.up_proj"] = np.ascontiguousarray(w1[:, :, half:].transpose(0, 2, 1))
    if "mlp.experts.weight2" in parts:
        out[key + "mlp.experts.down_proj"] = np.ascontiguousarray(parts.pop("mlp.experts.weight2").transpose(0, 2, 1))
    for o, t in _RENAMES:
        if t in parts:
            out[key + o] = parts.pop(t)
    if parts:
        raise UserError(f"checkpoint.load_path: '{theirs_prefix}{next(iter(parts))}' has no mindtrain "
                        "counterpart; the checkpoint is of another model")
    return out
