"""Legacy static-graph configs: detection and conversion to the flat eager form."""

from __future__ import annotations

import copy

from mindtrain.config.errors import ConfigError

_HINT = "run 'mindtrain-convert-config OLD.yaml NEW.yaml' to rewrite it"


def legacy_problems(raw: dict) -> list[str]:
    """What makes ``raw`` a legacy static-graph config (empty when it is not one)."""
    problems = []
    model = raw.get("model")
    if isinstance(model, dict):
        if "model_config" in model:
            problems.append("model.model_config: structure fields are nested; move them up one level under model:")
        arch = model.get("arch")
        if isinstance(arch, dict) and "type" in arch and "architectures" not in model:
            problems.append("model.arch: legacy class selector; use model.architectures as a string")
        archs = model.get("architectures", (model.get("model_config") or {}).get("architectures")
                          if isinstance(model.get("model_config"), dict) else None)
        if isinstance(archs, list):
            problems.append("model.architectures: is a list; write a single string such as DeepseekV3ForCausalLM")
    context = raw.get("context")
    if isinstance(context, dict) and context.get("mode") == 0:
        problems.append("context.mode: 0 is static graph; eager training uses mode 1 (or omit context.mode)")
    return problems


def check_not_legacy(raw: dict) -> None:
    problems = legacy_problems(raw)
    if problems:
        raise ConfigError("", f"this is a legacy static-graph config ({'; '.join(problems)}); {_HINT}")


# Legacy (MindFormers static-graph) names -> HF DeepSeek-V3 names.
_RENAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "multiple_of": None,
    "ffn_hidden_size": "intermediate_size",
    "layernorm_epsilon": "rms_norm_eps",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embedding": "max_position_embeddings",
    "theta": "rope_theta",
    "mtp_depth": "num_nextn_predict_layers",
}


def convert_legacy(raw: dict, known_model_fields: set[str]) -> tuple[dict, list[str]]:
    """Rewrite a legacy mapping into the flat eager form.

    Returns the new mapping and a list of notes (fields renamed or dropped) for the user.
    """
    new = copy.deepcopy(raw)
    notes: list[str] = []
    model = new.get("model") or {}
    flat: dict = {k: v for k, v in model.items() if k not in ("model_config", "arch")}
    nested = model.get("model_config") or {}
    if isinstance(nested, dict):
        for key, value in nested.items():
            if key == "type":
                notes.append(f"dropped model.model_config.type ({value})")
                continue
            target = _RENAMES.get(key, key)
            if target is None or target not in known_model_fields:
                notes.append(f"dropped model.model_config.{key} (no eager equivalent)")
                continue
            if target != key:
                notes.append(f"renamed model.model_config.{key} -> model.{target}")
            flat.setdefault(target, value)
    arch = flat.get("architectures")
    if isinstance(arch, list):
        flat["architectures"] = arch[0] if arch else "DeepseekV3ForCausalLM"
        notes.append(f"model.architectures: list -> {flat['architectures']!r}")
    if "model_type" not in flat:
        flat["model_type"] = "deepseek_v3"
    if isinstance(model.get("arch"), dict) and "architectures" not in flat:
        flat["architectures"] = "DeepseekV3ForCausalLM"
        notes.append("model.arch -> model.architectures: 'DeepseekV3ForCausalLM'")
    new["model"] = flat
    context = new.get("context")
    if isinstance(context, dict) and context.get("mode") == 0:
        context["mode"] = 1
        notes.append("context.mode: 0 -> 1 (eager)")
    return new, notes
