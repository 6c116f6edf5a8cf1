import os
import subprocess
import sys

import pytest
import yaml

from mindtrain.config import (
    ConfigError,
    MindTrainConfig,
    dump_config,
    load_config,
    num_accumulation_steps,
    parse_config,
    resolve_parallelism,
    warmup_steps,
)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONFIGS = os.path.join(ROOT, "configs")


def test_shipped_configs_validate():
    full = load_config(os.path.join(CONFIGS, "pynative_ds3.yaml"), world_size=2)
    assert full.model.hidden_size == 7168 and full.model.num_hidden_layers == 61
    assert full.model.n_routed_experts == 256 and full.model.rope_scaling["factor"] == 40
    assert full.train_dataset.dataloader.config.data_path == ["1", "/path/megatron_data_text_document"]
    tiny = load_config(os.path.join(CONFIGS, "pynative_ds3_tiny.yaml"), world_size=2)
    assert tiny.model.architectures == "DeepseekV3ForCausalLM"
    assert tiny.model.seq_length == tiny.train_dataset.dataloader.config.seq_length


def test_seed_values_and_types():
    cfg = load_config(os.path.join(CONFIGS, "pynative_ds3.yaml"))
    assert cfg.optimizer.eps == 1e-8 and isinstance(cfg.optimizer.eps, float)
    assert cfg.lr_scheduler.learning_rate == 1e-5
    assert cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.parallelism.data_parallel_shard == -1
    assert cfg.train_dataset.dataloader.sizes == [1000, 0, 0]
    assert cfg.context.mode == 1  # section omitted: eager by default


def test_overrides_are_typed():
    cfg = load_config(os.path.join(CONFIGS, "pynative_ds3_tiny.yaml"),
                      ["training.steps=20", "lr_scheduler.learning_rate=1e-4",
                       "optimizer.betas=[0.8, 0.9]", "checkpoint.enable_save=true"])
    assert cfg.training.steps == 20
    assert cfg.lr_scheduler.learning_rate == 1e-4  # "1e-4" is a string to PyYAML
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.checkpoint.enable_save is True


def test_round_trip(tmp_path):
    cfg = load_config(os.path.join(CONFIGS, "pynative_ds3.yaml"))
    out = tmp_path / "again.yaml"
    dump_config(cfg, str(out))
    assert load_config(str(out)) == cfg


def test_defaults_match_mindformers():
    # MindFormers' PyNative TrainConfig defaults (mindformers/pynative/config/config.py)
    cfg = MindTrainConfig()
    assert (cfg.training.steps, cfg.training.local_batch_size, cfg.training.global_batch_size,
            cfg.training.max_norm, cfg.training.seed, cfg.training.deterministic) == (1000, 1, 1, 1.0, 42, False)
    ck = cfg.checkpoint
    assert (ck.enable_save, ck.save_path, ck.save_max, ck.save_interleaved_steps, ck.prefix) == (
        True, "", 5, 1000, "checkpoint")
    assert cfg.parallelism.data_parallel_shard_strategy == "optim_grads_params"
    assert cfg.monitor.tensorboard.queue_size == 1000


def test_mindtrain_names_are_aliases():
    raw = yaml.safe_load(open(os.path.join(CONFIGS, "pynative_ds3_tiny.yaml")))
    cfg = parse_config(raw, ["checkpoint.keep_last=3", "checkpoint.save_interval=7", "checkpoint.load_optimizer=false",
                             "parallelism.pipeline_schedule=gpipe"])
    assert (cfg.checkpoint.save_max, cfg.checkpoint.save_interleaved_steps, cfg.checkpoint.no_load_optim) == (3, 7, True)
    assert cfg.parallelism.pipeline_parallel_schedule == "gpipe"
    with pytest.raises(ConfigError, match="checkpoint.keep_last: is another name for 'save_max'"):
        parse_config(raw, ["checkpoint.keep_last=3", "checkpoint.save_max=2"])


def test_derived_values():
    raw = yaml.safe_load(open(os.path.join(CONFIGS, "pynative_ds3_tiny.yaml")))
    cfg = parse_config(raw, ["training.global_batch_size=8", "parallelism.tensor_parallel=2",
                             "lr_scheduler.warmup_ratio=0.25", "training.steps=10"])
    dims = resolve_parallelism(cfg.parallelism, 8)
    assert (dims.pp, dims.dp_shard, dims.cp, dims.tp, dims.ep) == (1, 4, 1, 2, 1)
    assert dims.sequence_parallel
    assert num_accumulation_steps(cfg, dims) == 2
    assert warmup_steps(cfg.lr_scheduler, 10) == 2
    cfg.lr_scheduler.warmup_steps = 3
    assert warmup_steps(cfg.lr_scheduler, 10) == 3


def test_safe_loader_rejects_python_tags(tmp_path):
    bad = tmp_path / "evil.yaml"
    bad.write_text("training: !!python/object/apply:os.system ['echo hacked']\n")
    from mindtrain.config import ConfigError
    import pytest
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_config_imports_neither_numpy_nor_mindspore():
    code = ("import sys, mindtrain.config as c; c.load_config(sys.argv[1]); "
            "bad = [m for m in ('numpy', 'mindspore') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, os.path.join(CONFIGS, "pynative_ds3.yaml")], check=True)
