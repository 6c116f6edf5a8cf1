"""The model section in MindFormers' naming style, mapped onto mindtrain's (HF) fields.

MindFormers' DeepSeek-V3 YAMLs name the model with its TransformerConfig / MLATransformerConfig
fields (``mindformers/parallel_core/transformer_config.py``, ``config_converter_deepseek_v3.py``):
``params_dtype``, ``position_embedding_type: yarn`` with ``rotary_scaling_factor``,
``moe_aux_loss_coeff``, ... . Its Qwen3 and Qwen3-MoE converters
(``mindformers/models/qwen3/config_converter_qwen3.py``, ``qwen3_moe/config_converter_qwen3_moe.py``)
rename HF's ``head_dim`` to ``kv_channels``, ``num_key_value_heads`` to ``num_query_groups``,
``num_experts`` to ``num_moe_experts`` and so on (:data:`QWEN3_RENAMES`). :func:`to_canonical`
reads either style (or a mix) into the HF names the models package builds from, by
``model_type``; :func:`to_mindformers` writes the other way.
"""

from __future__ import annotations

from typing import Any, Callable

from mindtrain.config.errors import ConfigError
from mindtrain.config.families import FAMILY_NAMES, QWEN3_FAMILIES

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def norm_dtype(value: Any) -> Any:
    """MindFormers' short dtype names (bf16, fp32, fp16) -> the long ones."""
    return _DTYPES.get(value, value) if isinstance(value, str) else value


def _same(v: Any) -> Any:
    return v


# MindFormers name -> (HF field, value conversion). Same-named fields (hidden_size, seq_length,
# q_lora_rank, ...) need no entry.
RENAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "params_dtype": ("param_init_dtype", norm_dtype),
    "num_layers": ("num_hidden_layers", _same),
    "ffn_hidden_size": ("intermediate_size", _same),
    "layernorm_epsilon": ("rms_norm_eps", _same),
    "num_query_groups": ("num_key_value_heads", _same),
    "mtp_num_layers": ("num_nextn_predict_layers", _same),
    "mtp_loss_factor": ("mtp_loss_scaling_factor", _same),
    "init_method_std": ("initializer_range", _same),
    "moe_router_num_groups": ("n_group", _same),
    "num_moe_experts": ("n_routed_experts", _same),
    "moe_router_group_topk": ("topk_group", _same),
    "shared_expert_num": ("n_shared_experts", _same),
    "moe_router_topk": ("num_experts_per_tok", _same),
    "moe_ffn_hidden_size": ("moe_intermediate_size", _same),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor", _same),
    "rotary_base": ("rope_theta", _same),
    "qk_head_dim": ("qk_nope_head_dim", _same),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim", _same),
    "add_qkv_bias": ("attention_bias", _same),
    "moe_aux_loss_coeff": ("aux_loss_alpha", _same),
    "moe_router_bias_update_rate": ("bias_update_speed", _same),
}

# MindFormers names whose value must be this one for a DeepSeek-V3 (anything else is another
# model): name -> (accepted values, what the value means in words).
FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "scoring_func": (("sigmoid",), "DeepSeek-V3 routes with sigmoid scores"),
    "moe_router_score_function": (("sigmoid",), "DeepSeek-V3 routes with sigmoid scores"),
    "multi_latent_attention": ((True,), "DeepSeek-V3 attention is multi-latent attention (MLA)"),
    "gated_linear_unit": ((True,), "DeepSeek-V3 MLPs are gated (SwiGLU)"),
    "add_bias_linear": ((False,), "DeepSeek-V3 linear layers have no bias"),
    "normalization": (("RMSNorm",), "DeepSeek-V3 uses RMSNorm"),
    "topk_method": (("noaux_tc",), "DeepSeek-V3 selects experts by group-limited top-k with the bias"),
    "moe_router_load_balancing_type": (("seq_aux_loss", "none"),
                                       "mindtrain builds DeepSeek-V3's sequence-wise auxiliary loss "
                                       "(seq_aux_loss) or none"),
    "moe_token_dispatcher_type": (("alltoall",), "in the model section only alltoall is supported; "
                                  "set alltoall_deredundancy as parallelism.moe_token_dispatcher_type "
                                  "(MindFormers' PyNative field)"),
    "moe_layer_freq": ((1,), "mindtrain places MoE layers after first_k_dense_replace dense layers"),
}

# FIXED names DeepSeek-V4 gives other values (its router scores with sqrtsoftplus, its
# attention is not MLA, every layer is MoE, hash-routed layers first)
V4_OWN = ("scoring_func", "moe_router_score_function", "multi_latent_attention", "topk_method", "moe_layer_freq")

# YaRN parameters of MLATransformerConfig and their MindFormers defaults.
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_FACTOR_NAMES = ("rotary_scaling_factor", "scaling_factor")
# Accepted MindFormers-only switches kept as ModelConfig fields (kernels, dtypes): dtype-valued.
DTYPE_SWITCHES = ("layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype", "router_dense_type")

MINDFORMERS_ONLY = (set(RENAMES) | set(FIXED) | set(YARN_DEFAULTS) | set(YARN_FACTOR_NAMES)
                    | {"position_embedding_type", "moe_router_enable_expert_bias",
                       "moe_shared_expert_intermediate_size", "moe_router_pre_softmax", "qk_clip"})


def _set(out: dict, field: str, value: Any, source: str, path: str, origin: dict[str, str]) -> None:
    """Put ``value`` into ``out[field]``; the same quantity given twice must agree."""
    if field in out and out[field] != value:
        first = origin.get(field, field)
        raise ConfigError(f"{path}.{source}", f"gives {field} = {value!r}, but {first} already gives "
                          f"{out[field]!r}; the two names are the same quantity, keep one")
    out[field] = value
    origin.setdefault(field, field if source == field else source)


def _normalised(data: dict) -> dict:
    """A copy of ``data`` with ``num_key_value_heads`` defaulting to ``num_attention_heads``
    (as HF's DeepseekV3Config, Qwen3Config and MindFormers' TransformerConfig default it) and
    MindFormers' short dtype names made long."""
    data = dict(data)
    if "num_key_value_heads" not in data and "num_query_groups" not in data and "num_attention_heads" in data:
        data["num_key_value_heads"] = data["num_attention_heads"]
    for key in ("compute_dtype",) + DTYPE_SWITCHES:
        if key in data:
            data[key] = norm_dtype(data[key])
    return data


def _take_names(data: dict, path: str, is_hf: Callable[[str], bool],
                fixed: dict[str, tuple[tuple[Any, ...], str]], renames: dict[str, tuple[str, Callable[[Any], Any]]],
                on_fixed: Callable[[str, Any], dict[str, Any]]) -> tuple[dict, dict[str, str], dict]:
    """The key loop of :func:`to_canonical` for either family: ``data``'s HF names (``is_hf``)
    first, so a MindFormers name that disagrees is the one reported; then the ``fixed`` names
    (a value outside the allowed ones is an error; ``on_fixed(key, value)`` gives the fields
    it sets), then the ``renames``. Returns ``(out, origin, rest)``: the fields, the name each
    came from, and the names left for the family's own rules."""
    out: dict = {}
    origin: dict[str, str] = {}
    rest = dict(data)
    for key in [k for k in rest if is_hf(k)]:
        _set(out, key, rest.pop(key), key, path, origin)
    for key, (allowed, why) in fixed.items():
        if key in rest:
            value = rest.pop(key)
            if value not in allowed:
                shown = " or ".join(repr(a) for a in allowed)
                raise ConfigError(f"{path}.{key}", f"{value!r} is not supported: {why}; set it to {shown}")
            for field, v in on_fixed(key, value).items():
                _set(out, field, v, key, path, origin)
    for key, (field, conv) in renames.items():
        if key in rest:
            _set(out, field, conv(rest.pop(key)), key, path, origin)
    return out, origin, rest


def _map_swiglu(out: dict) -> None:
    """MindFormers' SwiGLU ``hidden_act`` as HF's: silu(gate) * up; fusedswiglu picks the fused kernel."""
    act = out.get("hidden_act")
    if act in ("fusedswiglu", "swiglu"):
        out["hidden_act"] = "silu"
        if act == "fusedswiglu" and out.get("bias_swiglu_fusion") is None:
            out["bias_swiglu_fusion"] = True


def to_canonical(data: dict, path: str = "model") -> dict:
    """A model mapping in either naming style -> the HF (mindtrain) names.

    Values that contradict the family (``model_type``, DeepSeek-V3 when absent) are one-line
    errors; the same quantity given in both styles with different values is an error.
    """
    if data.get("model_type") in QWEN3_FAMILIES:
        return _qwen3_canonical(data, path)
    fixed, hf_names, renames = FIXED, (), RENAMES
    if data.get("model_type") == "deepseek_v4":
        # V4 shares one key/value head (HF's default) and names its score function itself
        data = dict(data)
        if "num_key_value_heads" not in data and "num_query_groups" not in data:
            data["num_key_value_heads"] = 1
        fixed = {k: v for k, v in FIXED.items() if k not in V4_OWN}
        # MindFormers builds V4 as an MLA model in both attention variants (multi_latent_attention
        # true is its default; false is another attention, GQA)
        fixed["multi_latent_attention"] = ((True,), "DeepSeek-V4's attention is multi-latent (MindFormers "
                                                    "builds it so in both experimental_attention_variant's)")
        hf_names = ("scoring_func",)
        renames = dict(RENAMES, moe_router_score_function=("scoring_func", _same))
    # HF's DeepseekV3Config: num_key_value_heads defaults to num_attention_heads (MLA has one per head).
    data = _normalised(data)
    if (not any(k in MINDFORMERS_ONLY and k not in hf_names for k in data)
            and data.get("hidden_act") not in ("fusedswiglu", "swiglu")):
        return data
    out, origin, rest = _take_names(
        data, path, lambda k: k not in MINDFORMERS_ONLY or k in hf_names, fixed, renames,
        lambda key, value: {"aux_loss_alpha": 0.0} if key == "moe_router_load_balancing_type" and value == "none"
        else {})
    _map_swiglu(out)  # MindFormers' SwiGLU is DeepSeek-V3's MLP
    if "moe_router_enable_expert_bias" in rest:
        enabled = rest.pop("moe_router_enable_expert_bias")
        if not isinstance(enabled, bool):
            raise ConfigError(f"{path}.moe_router_enable_expert_bias", f"must be true or false, got {enabled!r}")
        if not enabled:
            _set(out, "bias_update_speed", 0.0, "moe_router_enable_expert_bias", path, origin)
    if "moe_router_pre_softmax" in rest:
        # Megatron's softmax-before-top-k; the DeepSeek routers score with sigmoid or
        # sqrtsoftplus, where MindFormers (as Megatron) does not read it
        pre = rest.pop("moe_router_pre_softmax")
        if not isinstance(pre, bool):
            raise ConfigError(f"{path}.moe_router_pre_softmax", f"must be true or false, got {pre!r}")
    if "qk_clip" in rest:
        # MindFormers' switch for recording the max attention logits; mindtrain records them
        # when optimizer.qk_clip_enabled (Muon) or a MaxLogitsMonitor callback asks
        clip = rest.pop("qk_clip")
        if not isinstance(clip, bool):
            raise ConfigError(f"{path}.qk_clip", f"must be true or false, got {clip!r}")
    if "moe_shared_expert_intermediate_size" in rest:
        size = rest.pop("moe_shared_expert_intermediate_size")
        shared, expert = out.get("n_shared_experts", 1), out.get("moe_intermediate_size", 2048)
        if size is not None and shared and size != shared * expert:
            raise ConfigError(f"{path}.moe_shared_expert_intermediate_size",
                              f"{size} must equal n_shared_experts x moe_intermediate_size = {shared}x{expert}"
                              f" = {shared * expert} (DeepSeek-V3's shared experts are one MLP of that size)")
    _yarn(rest, out, origin, path)
    assert not rest, rest
    return out


def _yarn(rest: dict, out: dict, origin: dict[str, str], path: str) -> None:
    kind = rest.pop("position_embedding_type", None)
    given = {k: rest.pop(k) for k in list(rest) if k in YARN_DEFAULTS or k in YARN_FACTOR_NAMES}
    if kind is None and not given:
        return
    if kind not in (None, "yarn", "rope"):
        raise ConfigError(f"{path}.position_embedding_type", f"{kind!r} is not supported; DeepSeek-V3 uses "
                          "\"yarn\" (or \"rope\" without scaling)")
    if kind == "rope" or kind is None:
        if given:
            name = next(iter(given))
            raise ConfigError(f"{path}.{name}", "is a YaRN setting; it needs position_embedding_type: yarn")
        _set(out, "rope_scaling", None, "position_embedding_type", path, origin)
        return
    factors = {given[n] for n in YARN_FACTOR_NAMES if n in given}
    if len(factors) > 1:
        raise ConfigError(f"{path}.scaling_factor", "and rotary_scaling_factor differ; they are the same "
                          "quantity, keep one")
    factor = factors.pop() if factors else 40.0
    # MindFormers' YaRN takes max_position_embeddings as the original (pre-extension) length.
    original = out.get("max_position_embeddings", 4096)
    rope = {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for k, default in YARN_DEFAULTS.items():
        rope[k] = given.get(k, default)
    source = "position_embedding_type"
    if "rope_scaling" in out and out["rope_scaling"] is not None:
        theirs = {k: v for k, v in out["rope_scaling"].items()}
        theirs.setdefault("type", theirs.pop("rope_type", "yarn"))
        if any(theirs.get(k) != v for k, v in rope.items()):
            raise ConfigError(f"{path}.position_embedding_type",
                              f"gives rope_scaling {rope}, but rope_scaling already gives {out['rope_scaling']}; "
                              "the two are the same quantity, keep one")
        return
    out["rope_scaling"] = rope
    origin["rope_scaling"] = source
    out["max_position_embeddings"] = int(round(float(factor) * original))


def to_mindformers(data: dict) -> dict:
    """HF-named model mapping -> MindFormers' names (the inverse of :func:`to_canonical`)."""
    if data.get("model_type") in QWEN3_FAMILIES:
        return _qwen3_to_mindformers(data)
    back = {"param_init_dtype": "params_dtype", "aux_loss_alpha": "moe_aux_loss_coeff",
            "bias_update_speed": "moe_router_bias_update_rate"}
    # MindFormers' own DeepSeek-V3 YAMLs keep HF names for the structure (num_hidden_layers,
    # n_routed_experts, ...) and use its names for the rest; write the same.
    out: dict = {}
    for key, value in data.items():
        if key == "rope_scaling":
            continue
        if key == "bias_swiglu_fusion":
            continue
        out[back.get(key, key)] = value
    if data.get("hidden_act") == "silu":
        out["hidden_act"] = "fusedswiglu" if data.get("bias_swiglu_fusion") else "swiglu"
    rope = data.get("rope_scaling")
    if rope:
        out["position_embedding_type"] = "yarn"
        out["max_position_embeddings"] = rope.get("original_max_position_embeddings", data.get("max_position_embeddings"))
        out["rotary_scaling_factor"] = rope.get("factor")
        for k in YARN_DEFAULTS:
            if k in rope:
                out[k] = rope[k]
    elif "rope_scaling" in data:
        out["position_embedding_type"] = "rope"
    if "bias_update_speed" in data:
        out["moe_router_enable_expert_bias"] = bool(data["bias_update_speed"])
    for key, value in (("multi_latent_attention", True), ("gated_linear_unit", True), ("add_bias_linear", False),
                       ("qk_layernorm", True), ("scoring_func", "sigmoid"),
                       ("moe_router_load_balancing_type", "seq_aux_loss" if data.get("aux_loss_alpha", 1) else "none")):
        out.setdefault(key, value)
    return out


# ----------------------------------------------------------------------------- Qwen3, Qwen3-MoE
def _negate(v: Any) -> Any:
    return not v if isinstance(v, bool) else v


# MindFormers' Qwen3 / Qwen3-MoE names (the converters' CONFIG_MAPPING, read backwards; HF's
# Qwen3-MoE names of the expert count) -> (field, value conversion).
QWEN3_RENAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "params_dtype": ("param_init_dtype", norm_dtype),
    "num_layers": ("num_hidden_layers", _same),
    "ffn_hidden_size": ("intermediate_size", _same),
    "layernorm_epsilon": ("rms_norm_eps", _same),
    "num_query_groups": ("num_key_value_heads", _same),
    "kv_channels": ("head_dim", _same),
    "init_method_std": ("initializer_range", _same),
    "rotary_base": ("rope_theta", _same),
    "add_qkv_bias": ("attention_bias", _same),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings", _negate),
    "num_moe_experts": ("n_routed_experts", _same),
    "num_experts": ("n_routed_experts", _same),          # HF Qwen3-MoE's name
    "num_local_experts": ("n_routed_experts", _same),    # what transformers 5 writes
    "moe_router_topk": ("num_experts_per_tok", _same),
    "moe_ffn_hidden_size": ("moe_intermediate_size", _same),
    "moe_router_dtype": ("router_dense_type", norm_dtype),
    "moe_aux_loss_coeff": ("router_aux_loss_coef", _same),
}

# MindFormers names whose value must be this one for a Qwen3 / Qwen3-MoE.
QWEN3_FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "multi_latent_attention": ((False,), "Qwen3 attention is grouped-query attention with per-head q/k norms, "
                                         "not multi-latent attention"),
    "gated_linear_unit": ((True,), "Qwen3 MLPs are gated (SwiGLU)"),
    "add_bias_linear": ((False,), "Qwen3's MLPs and router have no bias (add_qkv_bias / attention_bias gives "
                                  "the attention's)"),
    "normalization": (("RMSNorm",), "Qwen3 uses RMSNorm"),
    "position_embedding_type": (("rope",), "Qwen3 uses rope (rope_scaling holds HF's linear or yarn scaling)"),
    "scoring_func": (("softmax",), "Qwen3-MoE routes with softmax scores"),
    "moe_router_score_function": (("softmax",), "Qwen3-MoE routes with softmax scores"),
    "moe_router_enable_expert_bias": ((False,), "Qwen3-MoE has no expert bias"),
    "moe_router_topk_scaling_factor": ((1, 1.0, None), "Qwen3-MoE does not scale its routing weights"),
    "moe_shared_expert_intermediate_size": ((0, None), "Qwen3-MoE has no shared experts"),
    "shared_expert_num": ((0, None), "Qwen3-MoE has no shared experts"),
    "moe_router_load_balancing_type": (("none",), "mindtrain builds HF Qwen3-MoE's load-balancing loss "
                                                  "(output_router_logits with router_aux_loss_coef: one balance "
                                                  "over the micro-batch's tokens of all MoE layers), not "
                                                  "MindFormers' per-layer forms"),
    "moe_token_dispatcher_type": (("alltoall",), "in the model section only alltoall is supported; "
                                  "set alltoall_deredundancy as parallelism.moe_token_dispatcher_type "
                                  "(MindFormers' PyNative field)"),
    "use_sliding_window": ((False,), "sliding-window attention is not built (every layer attends causally "
                                     "over the whole sequence)"),
}
QWEN3_ONLY = set(QWEN3_RENAMES) | set(QWEN3_FIXED) | {"moe_layer_freq"}


def _qwen3_canonical(data: dict, path: str) -> dict:
    """:func:`to_canonical` for model_type qwen3 / qwen3_moe."""
    family = FAMILY_NAMES[data["model_type"]]
    # HF Qwen3Config and MindFormers' TransformerConfig: key/value heads default to the query heads
    data = _normalised(data)
    out, origin, rest = _take_names(
        data, path, lambda k: k not in QWEN3_ONLY and k not in MINDFORMERS_ONLY, QWEN3_FIXED, QWEN3_RENAMES,
        lambda key, value: {"output_router_logits": False} if key == "moe_router_load_balancing_type" else {})
    if "moe_aux_loss_coeff" in data and "output_router_logits" not in out:
        # MindFormers adds the auxiliary loss whenever its coefficient is > 0
        out["output_router_logits"] = bool(out["router_aux_loss_coef"])
    if "moe_layer_freq" in rest:
        _set(out, "mlp_only_layers", _mlp_only_layers(rest.pop("moe_layer_freq"), out, path), "moe_layer_freq",
             path, origin)
    _map_swiglu(out)
    for key in rest:
        if key in YARN_DEFAULTS or key in YARN_FACTOR_NAMES:
            raise ConfigError(f"{path}.{key}", f"is DeepSeek-V3's YaRN setting; {family} takes HF's rope_scaling "
                                               "({rope_type: yarn, factor, original_max_position_embeddings})")
        raise ConfigError(f"{path}.{key}", f"is a DeepSeek-V3 setting, which a {family} model does not read; "
                                           "remove it")
    return out


def _mlp_only_layers(freq: Any, out: dict, path: str) -> list[int]:
    """MindFormers' (Megatron's) ``moe_layer_freq`` as HF's ``mlp_only_layers``: an int N
    makes layer i a MoE layer when i % N == 0, a list gives 1 (MoE) or 0 (dense) per layer."""
    where = f"{path}.moe_layer_freq"
    n = out.get("num_hidden_layers")
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise ConfigError(where, f"must be an integer or a list of 0/1 per layer, got {freq!r}")
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(where, f"must be >= 1, got {freq}")
        if n is None:
            raise ConfigError(where, "needs num_hidden_layers (num_layers) to place the dense layers")
        return [i for i in range(n) if i % freq]
    if any(v not in (0, 1) or isinstance(v, bool) for v in freq) or (n is not None and len(freq) != n):
        raise ConfigError(where, f"must list 0 (dense) or 1 (MoE) for each of the {n} layers, got {freq!r}")
    return [i for i, v in enumerate(freq) if v == 0]


def _qwen3_to_mindformers(data: dict) -> dict:
    """:func:`to_mindformers` for model_type qwen3 / qwen3_moe: HF's names for the structure
    (as MindFormers' Qwen3 configs are HF config.json files), MindFormers' for the rest."""
    back = {"param_init_dtype": "params_dtype", "router_aux_loss_coef": "moe_aux_loss_coeff"}
    out: dict = {}
    for key, value in data.items():
        if key == "bias_swiglu_fusion":
            continue
        if key == "tie_word_embeddings":
            out["untie_embeddings_and_output_weights"] = _negate(value)
            continue
        if key == "n_routed_experts":
            out["num_experts"] = value
            continue
        out[back.get(key, key)] = value
    if "router_aux_loss_coef" in data:  # MindFormers' coefficient alone would also switch the loss on
        out["output_router_logits"] = bool(data.get("output_router_logits", False))
    if data.get("hidden_act") == "silu":
        out["hidden_act"] = "fusedswiglu" if data.get("bias_swiglu_fusion") else "swiglu"
    defaults: tuple[tuple[str, Any], ...] = (("multi_latent_attention", False), ("gated_linear_unit", True),
                                             ("add_bias_linear", False), ("qk_layernorm", True),
                                             ("normalization", "RMSNorm"), ("position_embedding_type", "rope"))
    if data.get("model_type") == "qwen3_moe":
        defaults += (("moe_router_score_function", "softmax"), ("moe_router_enable_expert_bias", False))
    for key, value in defaults:
        out.setdefault(key, value)
    return out
