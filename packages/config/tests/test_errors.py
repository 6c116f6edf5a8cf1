"""Every user mistake gets one line naming the field; the table covers SPEC 1.2's rules."""

import copy
import os
import subprocess
import sys

import pytest
import yaml

from mindtrain.config import ConfigError, load_config, parse_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = yaml.safe_load(open(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")))
DS = "train_dataset.dataloader"


def _drop(path):
    def edit(raw):
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        del node[last]
    return edit


CASES = [
    # (id, overrides, mutation, world_size, expected start of the message)
    ("unknown-top-level", ["trainig.steps=3"], None, None, "trainig: unknown key"),
    ("unknown-field-suggests", ["training.stpes=3"], None, None, "training.stpes: unknown key (did you mean 'steps'?)"),
    ("unknown-model-field", ["model.hidden_sise=3"], None, None, "model.hidden_sise: unknown key (did you mean 'hidden_size'?)"),
    ("wrong-type-int", ["training.steps=ten"], None, None, "training.steps: must be an integer"),
    ("wrong-type-bool", ["checkpoint.enable_save=maybe"], None, None, "checkpoint.enable_save: must be true or false"),
    ("wrong-type-list", ["optimizer.betas=0.9"], None, None, "optimizer.betas: must be a list of numbers"),
    ("section-not-mapping", ["training=5"], None, None, "training: must be a mapping"),
    ("steps-positive", ["training.steps=0"], None, None, "training.steps: must be a positive integer"),
    ("mode-static", ["context.mode=2"], None, None, "context.mode: only eager mode (1) is supported"),
    ("split-required", [], _drop(f"{DS}.config.split"), None, f"{DS}.config.split: required when data_path is set"),
    ("split-garbage", [f"{DS}.config.split=a,b"], None, None, f"{DS}.config.split: must be comma-separated numbers"),
    ("seq-mismatch", [f"{DS}.config.seq_length=128"], None, None, f"{DS}.config.seq_length: 128 must equal model.seq_length (256)"),
    ("columns-need-mask", [f"{DS}.config.create_attention_mask=true"], None, None, f"{DS}.column_names: must be"),
    ("columns-extra-mask", [f"{DS}.column_names=[input_ids, labels, loss_mask, position_ids, attention_mask]"], None, None, f"{DS}.column_names: must be"),
    ("data-path-odd", [f"{DS}.config.data_path=['1', a_text_document, '2']"], None, None, f"{DS}.config.data_path: must be pairs"),
    ("data-path-weight", [f"{DS}.config.data_path=[x, a_text_document]"], None, None, f"{DS}.config.data_path[0]: must be a sampling weight"),
    ("data-path-zero-weight", [f"{DS}.config.data_path=['0', a_text_document]"], None, None, f"{DS}.config.data_path[0]: weight must be > 0"),
    ("sizes-required", [], _drop(f"{DS}.sizes"), None, f"{DS}.sizes: is required"),
    ("datasets-type-required", [], _drop(f"{DS}.datasets_type"), None, f"{DS}.datasets_type: is required"),
    ("nested-config-required", [], _drop(f"{DS}.config"), None, f"{DS}.config: is required"),
    ("loader-type", [f"{DS}.type=HFDataLoader"], None, None, f"{DS}.type: must be 'BlendedMegatronDatasetDataLoader' or 'MindDataset'"),
    ("grad-accum-not-integer", ["training.global_batch_size=3"], None, 2, "training.global_batch_size: 3 must be a positive multiple"),
    ("parallel-product", ["parallelism.data_parallel_shard=3"], None, 2, "parallelism: data_parallel_shard x tensor_parallel"),
    ("parallel-minus-one-no-fit", ["parallelism.tensor_parallel=4", "model.num_attention_heads=4"], None, 2, "parallelism: tensor_parallel x context_parallel x pipeline_parallel = 4 does not divide"),
    ("degree-zero", ["parallelism.tensor_parallel=0"], None, None, "parallelism.tensor_parallel: must be a positive integer"),
    ("dp-shard-negative", ["parallelism.data_parallel_shard=-2"], None, None, "parallelism.data_parallel_shard: must be a positive integer"),
    ("experts-vs-ep", ["parallelism.expert_parallel=3"], None, None, "parallelism.expert_parallel: 3 must divide model.n_routed_experts (8)"),
    ("ep-vs-dp", ["parallelism.expert_parallel=4"], None, 2, "parallelism.expert_parallel: 4 must divide data_parallel_shard"),
    ("heads-vs-tp", ["parallelism.tensor_parallel=3"], None, None, "parallelism.tensor_parallel: 3 must divide model.num_attention_heads (4)"),
    ("cp-seq", ["parallelism.context_parallel=3"], None, None, "parallelism.context_parallel: model.seq_length (256) must be divisible by 2 x context_parallel = 6"),
    ("pp-layers", ["parallelism.pipeline_parallel=2", "parallelism.pipeline_layers_per_stage=[1, 1]"], None, None, "parallelism.pipeline_parallel_layers_per_stage: [1, 1]: layer counts must be >= 0 and sum to"),
    ("pp-schedule", ["parallelism.pipeline_schedule=interleaved"], None, None, "parallelism.pipeline_parallel_schedule: must be one of 1f1b, interleaved_1f1b, gpipe"),
    ("optimizer-type", ["optimizer.type=Lion"], None, None, "optimizer.type: must be 'AdamW' or 'Muon'"),
    ("betas", ["optimizer.betas=[0.9, 1.5]"], None, None, "optimizer.betas: must be two numbers in [0, 1)"),
    ("lr-type", ["lr_scheduler.type=OneCycle"], None, None, "lr_scheduler.type: unknown schedule 'OneCycle'"),
    ("lr-field-unused", ["lr_scheduler.power=2"], None, None, "lr_scheduler.power: is not used by ConstantWarmUpLR"),
    ("warmup-ratio", ["lr_scheduler.warmup_ratio=1.5"], None, None, "lr_scheduler.warmup_ratio: must be between 0 and 1"),
    ("model-type", ["model.model_type=llama"], None, None, "model.model_type: unknown model type 'llama'"),
    ("architectures-list", ["model.architectures=[DeepseekV3ForCausalLM]"], None, None, "this is a legacy static-graph config"),
    ("experts-vs-groups", ["model.n_routed_experts=6", "parallelism.expert_parallel=1"], None, None, "model.n_routed_experts: 6 is not divisible by n_group (4)"),
    ("topk-group", ["model.topk_group=5"], None, None, "model.topk_group: must be between 1 and n_group (4)"),
    ("experts-reachable", ["model.num_experts_per_tok=5"], None, None, "model.num_experts_per_tok: 5 exceeds the 4 experts reachable"),
    ("kv-heads", ["model.num_key_value_heads=2"], None, None, "model.num_key_value_heads: MLA uses one key/value head per query head"),
    ("dense-layers", ["model.first_k_dense_replace=9"], None, None, "model.first_k_dense_replace: must be between 0 and num_hidden_layers (3)"),
    ("rope-type", ["model.rope_scaling={type: linear, factor: 2}"], None, None, "model.rope_scaling.type: only 'yarn' is supported"),
    ("dtype", ["model.compute_dtype=float8"], None, None, "model.compute_dtype: must be one of float32, float16, bfloat16"),
    ("legacy-nested", ["model.model_config={hidden_size: 8}"], None, None, "this is a legacy static-graph config (model.model_config"),
    ("bad-override-syntax", ["training.steps"], None, None, "override 'training.steps' must look like section.field=value"),
]


@pytest.mark.parametrize("overrides,mutate,world,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_has_one_line_error(overrides, mutate, world, expected):
    raw = copy.deepcopy(TINY)
    if mutate:
        mutate(raw)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, overrides, world_size=world)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(expected), message


def test_table_is_large_enough():
    assert len(CASES) >= 20


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.yaml' does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


def test_invalid_yaml_names_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line"):
        load_config(str(bad))


def test_convert_cli_rewrites_legacy_and_result_validates(tmp_path):
    legacy = os.path.join(ROOT, "configs", "legacy", "deepseek3_static_tiny.yaml")
    with pytest.raises(ConfigError, match="mindtrain-convert-config"):
        load_config(legacy)
    out = tmp_path / "flat.yaml"
    proc = subprocess.run([sys.executable, "-m", "mindtrain.config.convert", legacy, str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "model.model_config.mtp_depth -> model.num_nextn_predict_layers" in proc.stdout
    cfg = load_config(str(out), world_size=2)
    assert cfg.model.architectures == "DeepseekV3ForCausalLM"
    assert cfg.model.n_routed_experts == 8 and cfg.model.num_experts_per_tok == 2
    assert cfg.model.num_nextn_predict_layers == 1
    assert cfg.parallelism.data_parallel_shard == 2
    assert cfg.context.mode == 1


def test_convert_cli_bad_input_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mindtrain.config.convert", str(tmp_path / "missing.yaml"),
                           str(tmp_path / "out.yaml")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
