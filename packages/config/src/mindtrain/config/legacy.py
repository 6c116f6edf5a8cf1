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
    for key in ("moe_config", "parallel_config", "runner_config", "lr_schedule"):
        if key in raw:
            problems.append(f"{key}: a static-graph section; its fields move into the eager sections")
    context = raw.get("context")
    if isinstance(context, dict) and context.get("mode") == 0:
        problems.append("context.mode: 0 is static graph; eager training uses mode 1 (or omit context.mode)")
    return problems


def check_not_legacy(raw: dict) -> None:
    problems = legacy_problems(raw)
    if problems:
        raise ConfigError("", f"this is a legacy static-graph config ({'; '.join(problems)}); {_HINT}")


# Legacy (MindFormers static-graph) names -> flat eager names. None drops the key.
_MODEL_RENAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "layernorm_epsilon": "rms_norm_eps",
    "max_position_embedding": "max_position_embeddings",
    "theta": "rope_theta",
    "mtp_depth": "num_nextn_predict_layers",
    "mtp_loss_factor": "mtp_loss_scaling_factor",
    "param_init_type": "param_init_dtype",
}
_MOE_RENAMES = {
    "expert_num": "n_routed_experts",
    "num_experts_chosen": "num_experts_per_tok",
    "shared_expert_num": "n_shared_experts",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
    "first_k_dense_replace": "first_k_dense_replace",
    "moe_intermediate_size": "moe_intermediate_size",
    "topk_group": "topk_group",
    "n_group": "n_group",
    "aux_loss_factor": "aux_loss_alpha",
    "topk_bias_update_rate": "bias_update_speed",
}
_PARALLEL_RENAMES = {
    "data_parallel": "data_parallel_shard",
    "model_parallel": "tensor_parallel",
    "expert_parallel": "expert_parallel",
    "context_parallel": "context_parallel",
    "pipeline_stage": "pipeline_parallel",
}


def _move(src: dict, renames: dict, dst: dict, known: set[str], where: str, notes: list[str]) -> None:
    for key, value in src.items():
        target = renames.get(key, key)
        if target is None or target not in known:
            notes.append(f"dropped {where}.{key} (no eager equivalent)")
            continue
        if target != key:
            notes.append(f"{where}.{key} -> {target}")
        dst[target] = value


def convert_legacy(raw: dict, fields: dict[str, set[str]]) -> tuple[dict, list[str]]:
    """Rewrite a legacy static-graph mapping into the flat eager form.

    ``fields`` maps each eager section name to its field names. Returns the new mapping and
    notes on what was renamed or dropped.
    """
    raw = copy.deepcopy(raw)
    notes: list[str] = []
    new: dict = {}
    for section in fields:
        if isinstance(raw.get(section), dict):
            new[section] = raw.pop(section)
    model = new.get("model", {})
    flat: dict = {}
    nested = model.pop("model_config", None) or {}
    arch = model.pop("arch", None)
    for key, value in model.items():
        flat[key] = value
    if isinstance(nested, dict):
        nested = {k: v for k, v in nested.items() if k not in ("type", "auto_register")}
        _move(nested, _MODEL_RENAMES, flat, fields["model"], "model.model_config", notes)
    moe = raw.pop("moe_config", None)
    if isinstance(moe, dict):
        _move(moe, _MOE_RENAMES, flat, fields["model"], "moe_config", notes)
    archs = flat.get("architectures")
    if isinstance(archs, list):
        flat["architectures"] = archs[0] if archs else "DeepseekV3ForCausalLM"
        notes.append(f"model.architectures: list -> {flat['architectures']!r}")
    if "architectures" not in flat:
        flat["architectures"] = (arch or {}).get("type", "DeepseekV3ForCausalLM") if isinstance(arch, dict) \
            else "DeepseekV3ForCausalLM"
        notes.append(f"model.arch -> model.architectures: {flat['architectures']!r}")
    flat.setdefault("model_type", "deepseek_v3")
    new["model"] = flat
    par = raw.pop("parallel_config", None)
    if isinstance(par, dict):
        _move(par, _PARALLEL_RENAMES, new.setdefault("parallelism", {}), fields["parallelism"],
              "parallel_config", notes)
    runner = raw.pop("runner_config", None)
    if isinstance(runner, dict) and "batch_size" in runner:
        training = new.setdefault("training", {})
        training.setdefault("local_batch_size", runner["batch_size"])
        notes.append("runner_config.batch_size -> training.local_batch_size")
        # static graph: global batch = batch_size x data_parallel x micro_batch_num x accumulation
        pcfg = par if isinstance(par, dict) else {}
        dp = new.get("parallelism", {}).get("data_parallel_shard", pcfg.get("data_parallel", 1))
        factor = runner.get("gradient_accumulation_steps", 1) or 1
        if new.get("parallelism", {}).get("pipeline_parallel", 1) > 1:
            factor *= pcfg.get("micro_batch_num", 1) or 1
        if isinstance(dp, int) and dp > 0 and "global_batch_size" not in training:
            training["global_batch_size"] = runner["batch_size"] * dp * factor
            notes.append(f"training.global_batch_size = batch_size x data_parallel x accumulation = "
                         f"{training['global_batch_size']}")
    if "seed" in raw and not isinstance(raw["seed"], dict):
        new.setdefault("training", {}).setdefault("seed", raw.pop("seed"))
        notes.append("seed -> training.seed")
    lr = raw.pop("lr_schedule", None)
    if isinstance(lr, dict):
        lr = {k: v for k, v in lr.items() if not (k == "total_steps" and v == -1)}
        _move(lr, {}, new.setdefault("lr_scheduler", {}), fields["lr_scheduler"], "lr_schedule", notes)
    ds = new.get("train_dataset")
    if isinstance(ds, dict) and "data_loader" in ds:
        ds["dataloader"] = ds.pop("data_loader")
        notes.append("train_dataset.data_loader -> train_dataset.dataloader")
    context = new.get("context")
    if isinstance(context, dict):
        if context.get("mode") == 0:
            notes.append("context.mode: 0 -> 1 (eager)")
        context["mode"] = 1
        for key in [k for k in context if k not in fields["context"]]:
            context.pop(key)
            notes.append(f"dropped context.{key} (no eager equivalent)")
    for key in raw:
        notes.append(f"dropped top-level '{key}' (no eager equivalent)")
    return new, notes
