"""Conversion between an HF ``config.json`` dict and mindtrain's flat ModelConfig, for each
family: DeepSeek-V3 (official names), DeepSeek-V4 (DeepseekV4Config's), Qwen3 and Qwen3-MoE (HF's Qwen3Config /
Qwen3MoeConfig names)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mindtrain.config import ConfigError, ModelConfig
from mindtrain.config.families import QWEN3_FAMILIES, family_fields, head_dim
from mindtrain.models.hf_v4_names import v4_from_hf, v4_to_hf

# HF's defaults for keys a Qwen3 config.json may leave out, where ModelConfig's (DeepSeek-V3's)
# differ: Qwen3Config.head_dim is 128 (Qwen3MoeConfig has none: hidden_size // heads),
# Qwen3MoeConfig.norm_topk_prob is false
_QWEN3_HF_DEFAULTS = {"qwen3": {"head_dim": 128}, "qwen3_moe": {"norm_topk_prob": False}}
# fields added for Qwen3 that DeepSeek-V3's config.json has never carried (its files stay as they were)
_NOT_IN_DEEPSEEK_JSON = frozenset(("head_dim", "qk_layernorm", "decoder_sparse_step", "mlp_only_layers",
                                   "router_aux_loss_coef", "output_router_logits"))


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from an HF config dict (the official DeepSeek-V3 one, a Qwen3 / Qwen3-MoE
    one, or what transformers 5.x writes with ``rope_parameters``). Only the fields the
    family reads are taken (:func:`mindtrain.config.families.family_fields`); HF keys that do
    not shape the model are ignored."""
    if "model_type" not in hf:
        raise ConfigError("config.json", "has no model_type; is this an HF model directory?")
    names = family_fields(hf["model_type"])
    kwargs: dict[str, Any] = {}
    for key, value in hf.items():
        if key in names:
            kwargs[key] = value
    if hf["model_type"] in QWEN3_FAMILIES:
        _qwen3_from_hf(hf, kwargs)
    arch = hf.get("architectures")
    if hf["model_type"] == "deepseek_v4":
        try:
            v4_from_hf(hf, kwargs)
        except ValueError as err:
            raise ConfigError("config.json", str(err)) from None
        if isinstance(arch, (list, tuple)) and arch:
            kwargs["architectures"] = arch[0]
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        kwargs.update(overrides)
        return ModelConfig(**kwargs)
    if isinstance(arch, (list, tuple)):
        if not arch:
            raise ConfigError("config.json.architectures", "is empty")
        kwargs["architectures"] = arch[0]
    rope = hf.get("rope_parameters")
    if rope and not hf.get("rope_scaling"):
        rope = dict(rope)
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope.pop("rope_theta")
        kind = rope.get("rope_type", rope.get("type", "default"))
        kwargs["rope_scaling"] = None if kind == "default" else rope
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _qwen3_from_hf(hf: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Qwen3 specifics of :func:`config_from_hf`: the expert count's names, HF's defaults
    for absent keys, sliding-window attention refused."""
    if hf.get("use_sliding_window"):
        raise ConfigError("config.json.use_sliding_window", "sliding-window attention is not built (every layer "
                                                            "attends causally over the whole sequence)")
    if hf["model_type"] == "qwen3_moe":
        for key in ("num_experts", "num_local_experts"):  # official / transformers 5's name
            if key in hf:
                kwargs["n_routed_experts"] = hf[key]
        if kwargs.get("mlp_only_layers") is None:
            kwargs["mlp_only_layers"] = []
    for key, value in _QWEN3_HF_DEFAULTS.get(hf["model_type"], {}).items():
        if key not in hf:
            kwargs[key] = value


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """HF ``config.json`` dict that transformers loads: DeepSeek-V3's official field names
    (``rope_scaling`` form), or Qwen3Config's / Qwen3MoeConfig's; training-only fields are
    kept as extra keys, fields of other families are left out. ``qk_layernorm: false`` (no
    q/k norms, which no HF config describes) is kept as the key ``qk_layernorm`` so a
    checkpoint's config.json reads back; :func:`refuse_without_hf_equivalent` stops an HF
    export of such a model."""
    if cfg.model_type in QWEN3_FAMILIES:
        return _qwen3_to_hf(cfg)
    if cfg.model_type == "deepseek_v4":
        names = family_fields(cfg.model_type)
        d = {k: v for k, v in dataclasses.asdict(cfg).items() if k in names}
        d["architectures"] = [cfg.architectures]
        d["torch_dtype"] = "float32"
        try:
            return v4_to_hf(d, cfg)
        except ValueError as err:
            raise ConfigError("model", str(err)) from None
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IN_DEEPSEEK_JSON}
    if not cfg.qk_layernorm:
        d["qk_layernorm"] = False  # mindtrain's key (HF has none): read back by config_from_hf
    d["architectures"] = [cfg.architectures]
    d["torch_dtype"] = "float32"
    return {k: v for k, v in d.items() if v is not None or k in ("q_lora_rank", "rope_scaling", "pad_token_id")}


def _qwen3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    names = family_fields(cfg.model_type)
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k in names}
    d["architectures"] = [cfg.architectures]
    if cfg.head_dim is None and cfg.model_type == "qwen3":
        d["head_dim"] = head_dim(cfg)  # HF Qwen3Config's default (128) is not hidden_size // heads
    d["use_sliding_window"] = False
    d["torch_dtype"] = "float32"
    if cfg.model_type == "qwen3_moe":
        d["num_experts"] = d.pop("n_routed_experts")
    if cfg.qk_layernorm:
        d.pop("qk_layernorm", None)  # HF Qwen3 always has q_norm / k_norm; false stays as mindtrain's key
    return {k: v for k, v in d.items() if v is not None or k in ("rope_scaling", "pad_token_id")}


def refuse_without_hf_equivalent(cfg: ModelConfig) -> None:
    """Raise ConfigError (one line) when transformers has no model for ``cfg``: without the
    q/k norms (``qk_layernorm: false``) HF's DeepseekV3 / DeepseekV4 / Qwen3 classes would still build them
    and fill them with ones (an RMSNorm, not the identity), a different model; DeepSeek-V4
    without hyper-connection streams (``enable_hyper_connections: false``) likewise."""
    if cfg.model_type == "deepseek_v4" and not cfg.enable_hyper_connections:
        raise ConfigError("model.enable_hyper_connections", "false (plain residual layers) has no HF model: "
                                                            "transformers' DeepSeek-V4 always builds the "
                                                            "hyper-connection streams; keep the mindtrain checkpoint")
    if not cfg.qk_layernorm:
        raise ConfigError("model.qk_layernorm", "false (no q/k norms) has no HF model: transformers' "
                                                "DeepSeek-V3 / V4 / Qwen3 always build the norms; keep the mindtrain "
                                                "checkpoint (train, evaluate and resume from it)")


__all__ = ["config_from_hf", "config_to_hf", "refuse_without_hf_equivalent"]
