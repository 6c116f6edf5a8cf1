"""DeepSeek-V4's HF formats (pure Python, no MindSpore; beside the deepseek_v4 folder so the checkpoint code
reads them without importing the model): config.json both ways, and the tensor
names of its checkpoint files.

transformers keeps V4 in memory under its own names (``model.layers.0.self_attn.q_a_proj.weight``,
stacked ``mlp.experts.gate_up_proj``) but reads and writes the released checkpoints' names
(``layers.0.attn.wq_a.weight``, per-expert ``ffn.experts.{e}.w1.weight``; its
``conversion_mapping`` for ``deepseek_v4``). mindtrain's parameters carry the in-memory names
(experts stacked as ``gate_proj`` / ``up_proj`` / ``down_proj``); :func:`file_to_model` and
:func:`model_to_file` map between the two. Files are written as transformers'
``save_pretrained`` writes them; both its form (``model.`` prefixes) and the released one
(none, ``embed.weight``, ``hc_head_fn``) are read.
"""

from __future__ import annotations

import re
from typing import Any, Optional

# file name -> model name, applied in order (transformers' WeightRenaming list for deepseek_v4)
_RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"(?<!\.shared_head)\.norm\.", ".kv_norm."),  # an attention's or compressor's norm, not an MTP module's
    (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_EXPERT_FILE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")

# model name -> file name, as transformers' save_pretrained writes them (the reverse of _RENAMES
# on the layer-level names; the top-level ones keep their model names but the head's)
_LAYER_REVERSE = [
    (".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
    (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
    (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
    (".self_attn.q_b_proj.", ".attn.wq_b."), (".self_attn.", ".attn."), (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.fn", ".hc_attn_fn"), (".attn_hc.base", ".hc_attn_base"), (".attn_hc.scale", ".hc_attn_scale"),
    (".ffn_hc.fn", ".hc_ffn_fn"), (".ffn_hc.base", ".hc_ffn_base"), (".ffn_hc.scale", ".hc_ffn_scale"),
    (".sinks", ".attn_sink"), (".kv_norm.", ".norm."), (".position_bias", ".ape"), (".q_a_proj.", ".wq_a."),
    (".kv_proj.", ".wkv."), (".gate_proj.", ".wgate."), (".o_a_proj.", ".wo_a."), (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."), (".gate.e_score_correction_bias", ".gate.bias"),
    (".shared_experts.wgate.", ".shared_experts.w1."), (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
]


def file_to_model(key: str) -> tuple[str, Optional[int]]:
    """``(model parameter name, expert index or None)`` of a checkpoint tensor name."""
    name = key[len("model."):] if key.startswith("model.") else key
    for src, dst in _RENAMES:
        name = re.sub(src, dst, name)
    name = name if name.startswith("lm_head.") else "model." + name
    m = _EXPERT_FILE.match(name)
    if m:
        return f"{m.group(1)}.{_EXPERT_PROJ[m.group(3)]}", int(m.group(2))
    return name, None


def model_to_file(name: str, shape) -> list[tuple[str, Optional[int]]]:
    """The checkpoint tensors (as transformers writes them) a model parameter is stored as:
    ``[(name, None)]``, or for the stacked experts one per expert ``(name, e)``."""
    if name == "lm_head.weight":
        return [("head.weight", None)]
    if not name.startswith("model.layers."):
        return [(name, None)]
    m = _STACKED.match(name)
    if m:
        w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[m.group(2)]
        return [(f"{m.group(1)}.ffn.experts.{e}.{w}.weight", e) for e in range(int(shape[0]))]
    out = name
    for src, dst in _LAYER_REVERSE:
        out = out.replace(src, dst)
    return [(out, None)]


_LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                "heavily_compressed_attention": "hca"}


def v4_from_hf(hf: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """DeepSeek-V4 specifics of ``config_from_hf``: HF's ``layer_types`` + ``compress_rates``
    (or the released ``compress_ratios``) into ``compress_ratios``, ``mlp_layer_types`` (or
    ``num_hash_layers``) into ``num_hash_layers``, the nested ``rope_parameters`` (``main`` /
    ``compress``) into rope_theta, compress_rope_theta and rope_scaling, the rope size from
    ``partial_rotary_factor``. Raises ValueError (the caller's ConfigError) on what mindtrain
    cannot express."""
    n = hf["num_hidden_layers"]
    kwargs.setdefault("scoring_func", "sqrtsoftplus")  # DeepseekV4Config's default
    kwargs.setdefault("num_key_value_heads", 1)
    # HF's model builds no MTP modules (its config.json's num_nextn_predict_layers describes the
    # released files) and adds no balance loss
    kwargs["num_nextn_predict_layers"] = 0
    kwargs.setdefault("aux_loss_alpha", 0.0)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update(hf.get("compress_rates") or {})
    for key, short in (("compress_rate_csa", "compressed_sparse_attention"),
                       ("compress_rate_hca", "heavily_compressed_attention")):
        if key in hf:
            rates[short] = hf[key]
    if hf.get("layer_types"):
        if rates["compressed_sparse_attention"] != 4 or rates["heavily_compressed_attention"] == 4:
            raise ValueError("compress_rates: compressed sparse attention pools 4 tokens and heavily compressed "
                             f"attention another count in mindtrain; got {rates}")
        ratios = []
        for t in hf["layer_types"]:
            if t not in _LAYER_TYPES:
                raise ValueError(f"layer_types: unknown layer type {t!r}")
            ratios.append(0 if t == "sliding_attention" else rates[t])
        kwargs["compress_ratios"] = ratios
    elif hf.get("compress_ratios") is not None:
        kwargs["compress_ratios"] = list(hf["compress_ratios"])
    else:  # HF's default schedule: 2 heavily compressed, then compressed sparse / heavily compressed
        kwargs["compress_ratios"] = ([rates["heavily_compressed_attention"]] * min(n, 2)
                                     + [4 if i % 2 else rates["heavily_compressed_attention"] for i in range(max(n - 2, 0))])
    mlp = hf.get("mlp_layer_types")
    if mlp:
        hashed = [t == "hash_moe" for t in mlp]
        k = sum(hashed)
        if hashed != [True] * k + [False] * (len(hashed) - k):
            raise ValueError("mlp_layer_types: hash-routed layers must come first (num_hash_layers)")
        kwargs["num_hash_layers"] = k
    elif "num_hash_layers" not in hf:
        kwargs["num_hash_layers"] = min(n, 3)
    if "n_routed_experts" not in hf and "num_local_experts" in hf:
        kwargs["n_routed_experts"] = hf["num_local_experts"]
    rope = hf.get("rope_parameters") or {}
    kwargs.pop("rope_scaling", None)
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        main, comp = dict(rope["main"]), dict(rope["compress"])
        kwargs["rope_theta"] = main.get("rope_theta", hf.get("rope_theta", 10000.0))
        kwargs["compress_rope_theta"] = comp.pop("rope_theta", hf.get("compress_rope_theta", 160000.0))
        factor = comp.pop("partial_rotary_factor", main.get("partial_rotary_factor"))
        comp.pop("attention_factor", None)
        kind = comp.get("rope_type", comp.get("type", "default"))
        kwargs["rope_scaling"] = None if kind == "default" else comp
    else:
        factor = hf.get("partial_rotary_factor")
        scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k not in ("rope_theta",)}
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        kwargs["rope_scaling"] = None if kind == "default" or not scaling else dict(scaling)
    if hf.get("qk_rope_head_dim"):
        kwargs["qk_rope_head_dim"] = hf["qk_rope_head_dim"]
    elif factor:
        kwargs["qk_rope_head_dim"] = int(hf["head_dim"] * factor)


def v4_to_hf(d: dict[str, Any], cfg) -> dict[str, Any]:
    """DeepSeek-V4 specifics of ``config_to_hf`` on ``d`` (the family's fields): DeepseekV4Config's
    ``layer_types``, ``compress_rates``, ``mlp_layer_types`` and nested ``rope_parameters``."""
    n = cfg.num_hidden_layers
    ratios = [int(r) for r in cfg.compress_ratios[:n]]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"compress_ratios: HF's DeepseekV4Config has one heavily compressed ratio, got {hca}")
    d.pop("compress_ratios")
    d["layer_types"] = ["sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4
                        else "heavily_compressed_attention" for r in ratios]
    d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128}
    d["mlp_layer_types"] = ["hash_moe"] * cfg.num_hash_layers + ["moe"] * (n - cfg.num_hash_layers)
    d.pop("num_hash_layers")
    factor = cfg.qk_rope_head_dim / cfg.head_dim
    comp = dict(cfg.rope_scaling) if cfg.rope_scaling else {"rope_type": "default"}
    comp.update(rope_theta=cfg.compress_rope_theta, partial_rotary_factor=factor)
    if comp.get("rope_type", comp.get("type")) == "yarn":
        comp.setdefault("attention_factor", 1.0)
    d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                     "partial_rotary_factor": factor}, "compress": comp}
    d.pop("rope_scaling", None)
    d["partial_rotary_factor"] = factor
    # the MTP modules, under DeepseekV4Config's own key (HF keeps the count but builds no module
    # and skips the ``mtp.*`` weights; mindtrain's from_pretrained builds and loads them)
    d["num_nextn_predict_layers"] = int(cfg.num_nextn_predict_layers)
    return {k: v for k, v in d.items() if v is not None or k == "pad_token_id"}
