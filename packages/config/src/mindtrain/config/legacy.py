"""Legacy static-graph configs: detection and conversion to the flat eager form."""

from __future__ import annotations

import copy
from typing import Any

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


# Old static-graph model names -> eager names (MindFormers' PyNative names are read by the loader
# as they are, see model_names.py).
_MODEL_RENAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "max_position_embedding": "max_position_embeddings",
    "theta": "rope_theta",
    "mtp_depth": "num_nextn_predict_layers",
    "param_init_type": "param_init_dtype",
}
_MOE_RENAMES = {
    "expert_num": "n_routed_experts",
    "num_experts_chosen": "num_experts_per_tok",
    "shared_expert_num": "n_shared_experts",
    "aux_loss_factor": "aux_loss_alpha",
    "topk_bias_update_rate": "bias_update_speed",
}
_MOE_DROPPED = {
    "capacity_factor": "mindtrain drops no tokens (no expert capacity)",
    "routing_policy": "DeepSeek-V3's group-limited sigmoid top-k router is the one built",
}
_PARALLEL_RENAMES = {
    "data_parallel": "data_parallel_shard",
    "model_parallel": "tensor_parallel",
    "expert_parallel": "expert_parallel",
    "context_parallel": "context_parallel",
    "pipeline_stage": "pipeline_parallel",
    "use_seq_parallel": "sequence_parallel",
}
# MindFormers' BlendedMegatronDatasetDataLoader defaults, written out for a dataset config that
# leaves them implicit (mindtrain wants every field given).
_DATASET_DEFAULTS = {"seed": 1234, "eod": -1, "pad": -1, "eod_mask_loss": False, "reset_position_ids": False,
                     "create_attention_mask": True, "reset_attention_mask": False,
                     "create_compressed_eod_mask": False, "eod_pad_length": 128}
_GRAPH_ONLY = "a static-graph setting with no eager equivalent"
_TOP_DROPPED = {
    "load_ckpt_format": "mindtrain reads safetensors only",
    "src_strategy_path_or_dir": "mindtrain reshards a loaded checkpoint by itself (no strategy files)",
    "auto_trans_ckpt": "mindtrain reshards a loaded checkpoint by itself",
    "only_save_strategy": "there are no strategy files in eager mode",
    "resume_training": "a command-line flag of run_mindformer.py (--resume_training)",
    "use_parallel": "a command-line flag of run_mindformer.py (--use_parallel)",
    "run_mode": "a command-line flag of run_mindformer.py (--run_mode)",
    "print_separate_loss": "the step line always shows load_balancing_loss and the MTP loss separately",
    "trainer": "mindtrain has one trainer",
    "train_dataset_task": "a copy of train_dataset for the static-graph task API",
    "micro_batch_interleave_num": _GRAPH_ONLY + " (graph-level micro-batch interleaving)",
    "use_legacy": "mindtrain has one DeepSeek-V3 implementation",
    "runner_wrapper": "the eager trainer's step (clipping is training.max_norm, loss scale not used in fp32/bf16)",
    "init_start_profile": "the profiler starts at profiler.start_step",
    "profile_communication": "MindSpore's profiler records what the device offers",
    "eval_dataset": "evaluation during training is the validation section (validation.data_path)",
    "eval_dataset_task": "evaluation during training is the validation section (validation.data_path)",
    "processor": "pretraining reads token ids; no tokenizer is needed",
}


class _Conversion:
    """One legacy mapping being rewritten; ``notes`` says what moved and what was dropped."""

    def __init__(self, raw: dict):
        self.raw = copy.deepcopy(raw)
        self.new: dict = {}
        self.notes: list[str] = []
        self._offset: Any = None
        self._interleave: Any = None
        self._micro: Any = None
        self._epochs: Any = None

    def put(self, dotted: str, value: Any, source: str, overwrite: bool = True) -> None:
        *parents, last = dotted.split(".")
        node = self.new
        for key in parents:
            node = node.setdefault(key, {})
        if not overwrite and last in node:
            return
        node[last] = value
        self.notes.append(f"{source} -> {dotted}")

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.new
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def drop(self, source: str, why: str) -> None:
        self.notes.append(f"dropped {source}: {why}")


def convert_legacy(raw: dict, fields: dict[str, set[str]]) -> tuple[dict, list[str]]:
    """Rewrite a legacy static-graph MindFormers config into the eager form.

    ``fields`` maps each eager section name to its field names. Every legacy key is moved to
    its eager place or named in the notes as dropped, with why.
    """
    c = _Conversion(raw)
    r = c.raw
    for key in ("checkpoint", "training", "parallelism", "lr_scheduler", "monitor", "profiler", "recompute",
                "recompute_comm", "swap", "compile"):
        if isinstance(r.get(key), dict):  # already-eager sections pass through
            c.new[key] = r.pop(key)
    _top_level(c, r)
    _model(c, r.pop("model", None) or {}, r.pop("moe_config", None), fields)
    _parallel(c, r.pop("parallel_config", None) or {}, r.pop("parallel", None) or {}, r)
    _runner(c, r.pop("runner_config", None) or {})
    _optimizer(c, r.pop("optimizer", None))
    _lr(c, r.pop("lr_schedule", None) or r.pop("lr_scheduler", None))
    _dataset(c, r.pop("train_dataset", None))
    _context(c, r.pop("context", None), fields["context"])
    _recompute(c, r.pop("recompute_config", None))
    _callbacks(c, r.pop("callbacks", None))
    _profile(c, r)
    for key, why in _TOP_DROPPED.items():
        if key in r:
            r.pop(key)
            c.drop(key, why)
    for key in list(r):
        c.drop(key, _GRAPH_ONLY)
    return c.new, c.notes


def _top_level(c: _Conversion, r: dict) -> None:
    if "seed" in r and not isinstance(r["seed"], dict):
        c.put("training.seed", r.pop("seed"), "seed")
    out = r.pop("output_dir", None)
    if out:
        c.put("checkpoint.save_path", f"{str(out).rstrip('/')}/checkpoint", "output_dir")
    for key in ("load_checkpoint", "pretrained_model_dir"):
        value = r.pop(key, None)
        if value and not c.get("checkpoint.load_path"):
            c.put("checkpoint.load_path", value, key)
        elif value is not None:
            c.drop(key, "empty" if not value else "load_checkpoint is used")
    if "train_precision_sync" in r:
        c.put("training.deterministic", bool(r.pop("train_precision_sync")), "train_precision_sync")


def _model(c: _Conversion, model: dict, moe: Any, fields: dict[str, set[str]]) -> None:
    flat: dict = {}
    nested = model.pop("model_config", None) or {}
    arch = model.pop("arch", None)
    for key, value in model.items():
        flat[key] = value
    for key in ("type", "auto_register"):
        if key in nested:
            nested.pop(key)
            c.drop(f"model.model_config.{key}", "the model class is model.architectures")
    offset = nested.pop("offset", None)
    interleave = nested.pop("pp_interleave_num", None)
    for key, value in nested.items():
        target = _MODEL_RENAMES.get(key, key)
        if target != key:
            c.notes.append(f"model.model_config.{key} -> model.{target}")
        flat[target] = value
    if isinstance(moe, dict):
        for key, value in moe.items():
            if key in _MOE_DROPPED:
                c.drop(f"moe_config.{key}", _MOE_DROPPED[key])
                continue
            target = _MOE_RENAMES.get(key, key)
            c.notes.append(f"moe_config.{key} -> model.{target}")
            flat[target] = value
    archs = flat.get("architectures")
    if isinstance(archs, list):
        flat["architectures"] = archs[0] if archs else "DeepseekV3ForCausalLM"
        c.notes.append(f"model.architectures: list -> {flat['architectures']!r}")
    if "architectures" not in flat:
        flat["architectures"] = arch.get("type", "DeepseekV3ForCausalLM") if isinstance(arch, dict) \
            else "DeepseekV3ForCausalLM"
        c.notes.append(f"model.arch -> model.architectures: {flat['architectures']!r}")
    flat.setdefault("model_type", "deepseek_v3")
    c.new["model"] = flat
    c._offset, c._interleave = offset, interleave  # resolved with the pipeline degrees


def _layers_per_stage(c: _Conversion, pp: int) -> None:
    offset, chunks = c._offset, c._interleave or 1
    if chunks and chunks > 1:
        c.put("parallelism.pipeline_parallel_interleave_num", chunks, "model.model_config.pp_interleave_num")
    if offset in (None, 0) or pp <= 1:
        if offset not in (None, 0):
            c.drop("model.model_config.offset", "no pipeline parallelism")
        return
    layers = c.new["model"].get("num_hidden_layers", 61)
    rows = offset if isinstance(offset[0], list) else [offset]
    if len(rows) != chunks or any(len(row) != pp for row in rows):
        c.drop("model.model_config.offset", f"its shape does not match {chunks} chunk(s) x {pp} stages; "
                                            "the layers are balanced automatically")
        return
    base = layers // (pp * chunks)
    counts = [base + rows[chunk][stage] for chunk in range(chunks) for stage in range(pp)]
    c.put("parallelism.pipeline_parallel_layers_per_stage", counts, "model.model_config.offset")


def _parallel(c: _Conversion, par: dict, parallel: dict, r: dict) -> None:
    for key, value in par.items():
        if key in _PARALLEL_RENAMES:
            c.put(f"parallelism.{_PARALLEL_RENAMES[key]}", value, f"parallel_config.{key}")
        elif key == "micro_batch_num":
            c._micro = value
            if par.get("pipeline_stage", 1) > 1:
                c.put("parallelism.pipeline_parallel_microbatch_size", value, "parallel_config.micro_batch_num")
            else:
                c.drop("parallel_config.micro_batch_num", "no pipeline parallelism")
        elif key == "gradient_aggregation_group":
            c.drop(f"parallel_config.{key}", _GRAPH_ONLY + " (gradient fusion groups)")
        elif key == "vocab_emb_dp":
            c.drop(f"parallel_config.{key}", "the embedding follows the tensor-parallel split")
        else:
            c.drop(f"parallel_config.{key}", _GRAPH_ONLY)
    pp = c.get("parallelism.pipeline_parallel", 1)
    tp = c.get("parallelism.tensor_parallel", 1)
    if c.get("parallelism.sequence_parallel") is False and tp > 1:
        c.put("parallelism.sequence_parallel", True, "parallel_config.use_seq_parallel (eager TP needs it)")
    pipeline = parallel.pop("pipeline_config", None) or {}
    for key, value in pipeline.items():
        if key == "pipeline_interleave":
            if not value:
                c._interleave = 1
            c.drop("parallel.pipeline_config.pipeline_interleave",
                   "interleaving follows parallelism.pipeline_parallel_interleave_num")
        elif key == "pipeline_scheduler":
            c.drop("parallel.pipeline_config.pipeline_scheduler",
                   f"{value!r} is a static-graph schedule; eager runs 1f1b (interleaved with chunks > 1)")
        else:
            c.drop(f"parallel.pipeline_config.{key}", _GRAPH_ONLY)
    _layers_per_stage(c, pp)
    if "gradients_mean" in parallel:
        value = parallel.pop("gradients_mean")
        c.put("parallelism.disable_gradient_division", not value, "parallel.gradients_mean (negated)")
    why = {
        "parallel_mode": "eager mode lays out each strategy explicitly (parallelism degrees)",
        "search_mode": "eager mode has no sharding search",
        "enable_alltoall": "expert parallelism always dispatches with all-to-all",
        "enable_parallel_optimizer": "FSDP always shards (parallelism.data_parallel_shard_strategy)",
        "strategy_ckpt_config": "there are no strategy files in eager mode",
        "parallel_optimizer_config": "FSDP shards every parameter over data_parallel_shard "
                                     "(parallelism.data_parallel_shard_strategy)",
        "full_batch": "each data-parallel rank reads its own batch",
    }
    for key in list(parallel):
        parallel.pop(key)
        c.drop(f"parallel.{key}", why.get(key, _GRAPH_ONLY))


def _runner(c: _Conversion, runner: dict) -> None:
    batch = runner.pop("batch_size", None)
    if batch is not None:
        c.put("training.local_batch_size", batch, "runner_config.batch_size", overwrite=False)
        dp = c.get("parallelism.data_parallel_shard", 1)
        factor = runner.pop("gradient_accumulation_steps", 1) or 1
        if c.get("parallelism.pipeline_parallel", 1) > 1:
            factor *= getattr(c, "_micro", 1) or 1
        if isinstance(dp, int) and dp > 0 and c.get("training.global_batch_size") is None:
            c.new["training"]["global_batch_size"] = batch * dp * factor
            c.notes.append(f"training.global_batch_size = batch_size x data_parallel x micro-batches/accumulation "
                           f"= {batch * dp * factor}")
    epochs = runner.pop("epochs", None)
    c._epochs = epochs
    for key in list(runner):
        runner.pop(key)
        c.drop(f"runner_config.{key}", "graph sinking" if key.startswith("sink") else _GRAPH_ONLY)


def _optimizer(c: _Conversion, opt: Any) -> None:
    if not isinstance(opt, dict):
        return
    if "swap" in opt:
        opt.pop("swap")
        c.drop("optimizer.swap", "optimizer-state swapping to host is a static-graph feature; FSDP shards "
                                 "the optimizer state instead")
    c.new["optimizer"] = opt


def _lr(c: _Conversion, lr: Any) -> None:
    if not isinstance(lr, dict):
        return
    if lr.get("total_steps") in (-1, None):
        lr.pop("total_steps", None)
        c.drop("lr_schedule.total_steps", "-1 (the whole run): the schedule spans training.steps")
    from mindtrain.config.validate import LR_SCHEDULES

    used = LR_SCHEDULES.get(lr.get("type", "ConstantWarmUpLR"), set())
    for name in ("lr_end", "power", "num_cycles", "decay_ratio"):
        if name in lr and name not in used:
            lr.pop(name)
            c.drop(f"lr_schedule.{name}", f"not used by {lr.get('type', 'ConstantWarmUpLR')}")
    c.new.setdefault("lr_scheduler", {}).update(lr)
    c.notes.append("lr_schedule -> lr_scheduler")


def _dataset(c: _Conversion, ds: Any) -> None:
    if not isinstance(ds, dict):
        return
    loader = ds.pop("data_loader", None) or ds.pop("dataloader", None) or {}
    out: dict = {}
    seq = c.new["model"].get("seq_length", 4096)
    if loader.get("type") == "HFDataLoader":
        c.drop("train_dataset.data_loader (HFDataLoader)",
               "Hugging Face datasets are not read by mindtrain; tokenize them with preprocess_indexed_dataset.py "
               "and set train_dataset.dataloader.config.data_path (a placeholder is written)")
        loader = {"type": "BlendedMegatronDatasetDataLoader", "shuffle": loader.get("shuffle", False),
                  "config": {"seq_length": seq, "split": "1, 0, 0",
                             "data_path": ["1", "/path/to/your_dataset_text_document"]}}
    else:
        c.notes.append("train_dataset.data_loader -> train_dataset.dataloader")
    loader.setdefault("datasets_type", "GPTDataset") if loader.get("type") == "BlendedMegatronDatasetDataLoader" \
        else None
    config = loader.get("config")
    if isinstance(config, dict):
        named = loader.get("column_names") or ds.get("input_columns")
        if named and "create_attention_mask" not in config:
            # the columns the config names decide it (MindFormers would return only those)
            config["create_attention_mask"] = "attention_mask" in named
            c.notes.append(f"train_dataset.dataloader.config.create_attention_mask: {config['create_attention_mask']}"
                           " (from the column names)")
        for key, value in _DATASET_DEFAULTS.items():
            if key not in config:
                config[key] = value
                c.notes.append(f"train_dataset.dataloader.config.{key}: MindFormers' default {value!r} written out")
    if "sizes" not in loader and loader.get("type") == "BlendedMegatronDatasetDataLoader":
        steps = c.get("training.steps", 1000)
        loader["sizes"] = [steps * (c.get("training.global_batch_size") or 1), 0, 0]
        c.notes.append(f"train_dataset.dataloader.sizes: {loader['sizes']} (training.steps x global_batch_size)")
    columns = ds.pop("input_columns", None)
    if columns and "column_names" not in loader:
        loader["column_names"] = columns
        c.notes.append("train_dataset.input_columns -> train_dataset.dataloader.column_names")
    if "construct_args_key" in ds:
        ds.pop("construct_args_key")
        c.drop("train_dataset.construct_args_key", "the model's inputs are the dataset columns")
    if isinstance(config, dict) and "column_names" not in loader:
        mask = config.get("create_attention_mask") or config.get("create_compressed_eod_mask")
        loader["column_names"] = ["input_ids", "labels", "loss_mask", "position_ids"] + (
            ["attention_mask"] if mask else [])
    if "python_multiprocessing" in ds:
        loader["python_multiprocessing"] = ds.pop("python_multiprocessing")
        c.notes.append("train_dataset.python_multiprocessing -> train_dataset.dataloader.python_multiprocessing")
    if "seed" in ds:
        ds.pop("seed")
        c.drop("train_dataset.seed", "the loader's order follows training.seed and the dataset config's seed")
    for key in ("batch_size", "repeat", "do_eval"):
        if key in ds:
            ds.pop(key)
            c.drop(f"train_dataset.{key}", "batches come from training.local_batch_size")
    out["dataloader"] = loader
    out.update(ds)  # drop_remainder, num_parallel_workers, prefetch_size, numa_enable keep their names
    c.new["train_dataset"] = out
    if c._epochs and loader.get("sizes") and c.get("training.steps") is None:
        gbs = c.get("training.global_batch_size") or 1
        steps = max(1, c._epochs * loader["sizes"][0] // gbs)
        c.new.setdefault("training", {})["steps"] = steps
        c.notes.append(f"runner_config.epochs -> training.steps = epochs x sizes[0] / global_batch_size = {steps}")


def _context(c: _Conversion, context: Any, known: set[str]) -> None:
    if not isinstance(context, dict):
        return
    if context.get("mode") == 0:
        c.notes.append("context.mode: 0 -> 1 (eager)")
    context["mode"] = 1
    for key in [k for k in context if k not in known]:
        context.pop(key)
        c.drop(f"context.{key}", "a graph-compiler or memory-pool setting with no eager equivalent")
    c.new["context"] = context


def _recompute(c: _Conversion, rc: Any) -> None:
    if not isinstance(rc, dict):
        return
    present = {k for k in ("recompute", "select_recompute") if k in rc}
    full, select = rc.pop("recompute", False), rc.pop("select_recompute", False)
    if full:
        c.put("recompute.mode", "full", "recompute_config.recompute")
        if isinstance(full, list):
            c.drop("recompute_config.recompute (per-stage layer counts)", "recompute.full_recompute_layer takes "
                   "layer ids; every layer is recomputed")
        if select:
            c.drop("recompute_config.select_recompute", "whole layers are recomputed (recompute: true)")
    elif select:
        c.put("recompute.mode", "select", "recompute_config.select_recompute")
        if isinstance(select, (list, dict)):
            c.put("recompute.select_module", select, "recompute_config.select_recompute")
    for key, value in ((k, v) for k, v in (("recompute", full), ("select_recompute", select))
                       if not v and k in present):
        c.drop(f"recompute_config.{key}", f"{value!r} (off)")
    for key in ("mp_comm_recompute", "select_comm_recompute"):
        if key in rc:
            if rc.pop(key):
                c.put("recompute_comm.enable", True, f"recompute_config.{key}")
            else:
                c.drop(f"recompute_config.{key}", "false (off)")
    for key in list(rc):
        rc.pop(key)
        c.drop(f"recompute_config.{key}", _GRAPH_ONLY)


def _callbacks(c: _Conversion, callbacks: Any) -> None:
    for i, cb in enumerate(callbacks or []):
        kind = cb.get("type") if isinstance(cb, dict) else None
        if kind == "CheckpointMonitor":
            moves = {"prefix": "checkpoint.prefix", "save_checkpoint_steps": "checkpoint.save_interleaved_steps",
                     "keep_checkpoint_max": "checkpoint.save_max", "async_save": "checkpoint.async_save"}
            for key, value in cb.items():
                if key in moves:
                    c.put(moves[key], value, f"callbacks[{i}].{key}")
                elif key == "integrated_save":
                    c.put("checkpoint.remove_redundancy", not value, f"callbacks[{i}].integrated_save (negated)")
                elif key == "checkpoint_format":
                    c.drop(f"callbacks[{i}].checkpoint_format", "checkpoints are safetensors")
                elif key != "type":
                    c.drop(f"callbacks[{i}].{key}", _GRAPH_ONLY)
            c.put("checkpoint.enable_save", True, f"callbacks[{i}] (CheckpointMonitor)", overwrite=False)
        elif kind == "MFLossMonitor":
            c.drop(f"callbacks[{i}] (MFLossMonitor)", "every worker prints the step line")
        elif kind == "TopkBiasBalanceCallback":
            c.drop(f"callbacks[{i}] (TopkBiasBalanceCallback)",
                   "the expert-bias update is built in (model.bias_update_speed)")
        else:
            c.drop(f"callbacks[{i}] ({kind})", "a static-graph callback; eager callbacks are registered classes "
                                                "(callbacks: [{type: ...}] with --register_path)")


def _profile(c: _Conversion, r: dict) -> None:
    if "profile" in r:
        c.put("profiler.enable_profiling", bool(r.pop("profile")), "profile")
    for old, new in (("profile_start_step", "start_step"), ("profile_stop_step", "end_step"),
                     ("profile_memory", "profile_memory")):
        if old in r:
            c.put(f"profiler.{new}", r.pop(old), old)
