"""Conversion between an HF ``config.json`` dict and mindtrain's flat ModelConfig."""

from __future__ import annotations

import dataclasses
from typing import Any

from mindtrain.config import ConfigError, ModelConfig



def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig from an HF config dict (the official DeepSeek-V3 one, or what transformers
    5.x writes with ``rope_parameters``). HF keys that do not shape the model are ignored."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in hf.items():
        if key in names:
            kwargs[key] = value
    if "model_type" not in hf:
        raise ConfigError("config.json", "has no model_type; is this an HF model directory?")
    arch = hf.get("architectures")
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


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """HF ``config.json`` dict (official DeepSeek-V3 field names, ``rope_scaling`` form) that
    transformers' DeepseekV3Config loads; training-only fields are kept as extra keys."""
    d = dataclasses.asdict(cfg)
    d["architectures"] = [cfg.architectures]
    d["torch_dtype"] = "float32"
    return {k: v for k, v in d.items() if v is not None or k in ("q_lora_rank", "rope_scaling", "pad_token_id")}


__all__ = ["config_from_hf", "config_to_hf"]
