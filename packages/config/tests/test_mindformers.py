"""MindFormers compatibility of the config: model names in both styles, notes for what has no
effect, refusals for what is not built, section forms, required dataset fields, and the
legacy converter on a static-graph config that uses every key MindFormers' DeepSeek-V3 ones use."""

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from mindtrain.config import (ConfigError, ModelConfig, from_dict, load_config, parse_config, startup_notes,
                              validate_device)
from mindtrain.config.convert import restyle

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY_PATH = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
MF_PATH = os.path.join(ROOT, "configs", "mindformers_ds3_tiny.yaml")
TINY = yaml.safe_load(open(TINY_PATH))
MF = yaml.safe_load(open(MF_PATH))
STRUCTURE = [f.name for f in dataclasses.fields(ModelConfig)
             if f.name not in ("use_flash_attention", "moe_grouped_gemm", "mla_qkv_concat", "bias_swiglu_fusion",
                               "apply_rope_fusion", "use_fused_ops_topkrouter", "use_attn_mask_compression",
                               "layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype",
                               "router_dense_type", "moe_token_drop_policy", "use_pad_tokens")]


def _model(section):
    return from_dict(ModelConfig, section, "model")


# ----------------------------------------------------------------------------- model names
# (MindFormers name, value, HF field, value the HF field gets)
RENAMED = [
    ("params_dtype", "fp32", "param_init_dtype", "float32"),
    ("num_layers", 5, "num_hidden_layers", 5),
    ("ffn_hidden_size", 96, "intermediate_size", 96),
    ("layernorm_epsilon", 1e-5, "rms_norm_eps", 1e-5),
    ("num_query_groups", 8, "num_key_value_heads", 8),
    ("mtp_num_layers", 2, "num_nextn_predict_layers", 2),
    ("mtp_loss_factor", 0.3, "mtp_loss_scaling_factor", 0.3),
    ("init_method_std", 0.01, "initializer_range", 0.01),
    ("moe_router_num_groups", 2, "n_group", 2),
    ("num_moe_experts", 16, "n_routed_experts", 16),
    ("moe_router_group_topk", 1, "topk_group", 1),
    ("shared_expert_num", 2, "n_shared_experts", 2),
    ("moe_router_topk", 3, "num_experts_per_tok", 3),
    ("moe_ffn_hidden_size", 48, "moe_intermediate_size", 48),
    ("moe_router_topk_scaling_factor", 1.5, "routed_scaling_factor", 1.5),
    ("rotary_base", 50000.0, "rope_theta", 50000.0),
    ("qk_head_dim", 64, "qk_nope_head_dim", 64),
    ("qk_pos_emb_head_dim", 32, "qk_rope_head_dim", 32),
    ("add_qkv_bias", True, "attention_bias", True),
    ("moe_aux_loss_coeff", 0.002, "aux_loss_alpha", 0.002),
    ("moe_router_bias_update_rate", 0.01, "bias_update_speed", 0.01),
    ("moe_router_enable_expert_bias", False, "bias_update_speed", 0.0),
    ("hidden_act", "swiglu", "hidden_act", "silu"),
    ("compute_dtype", "bf16", "compute_dtype", "bfloat16"),
    ("moe_router_load_balancing_type", "none", "aux_loss_alpha", 0.0),
]


@pytest.mark.parametrize("mf, value, hf, expected", RENAMED, ids=[r[0] for r in RENAMED])
def test_mindformers_name_maps_onto_its_hf_field(mf, value, hf, expected):
    got = _model({mf: value})
    assert getattr(got, hf) == expected
    assert got == _model({hf: expected})  # the same config as written with the HF name


def test_fusedswiglu_is_silu_with_the_fused_kernel_switch():
    m = _model({"hidden_act": "fusedswiglu"})
    assert m.hidden_act == "silu" and m.bias_swiglu_fusion is True


def test_yarn_in_mindformers_names():
    m = _model({"position_embedding_type": "yarn", "rotary_scaling_factor": 40, "max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    assert m.rope_scaling == {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert m.max_position_embeddings == 40 * 4096  # the HF meaning: the extended length
    # the legacy name of the factor, and MindFormers' defaults for what is left out
    legacy = _model({"position_embedding_type": "yarn", "scaling_factor": 40, "max_position_embeddings": 4096})
    assert legacy.rope_scaling["factor"] == 40 and legacy.rope_scaling["mscale"] == 0.707
    assert _model({"position_embedding_type": "rope"}).rope_scaling is None


def test_the_two_tiny_configs_are_the_same_model():
    hf, mf = load_config(TINY_PATH).model, load_config(MF_PATH, world_size=2).model
    assert [getattr(hf, n) for n in STRUCTURE] == [getattr(mf, n) for n in STRUCTURE]


@pytest.mark.parametrize("mf, value, hf, other", [
    ("params_dtype", "float32", "param_init_dtype", "bfloat16"),
    ("moe_aux_loss_coeff", 0.01, "aux_loss_alpha", 0.001),
    ("num_moe_experts", 16, "n_routed_experts", 8),
    ("mtp_num_layers", 1, "num_nextn_predict_layers", 0),
])
def test_same_quantity_in_both_styles_must_agree(mf, value, hf, other):
    with pytest.raises(ConfigError, match=rf"^model\.{mf}: gives {hf} = .* already gives"):
        _model({mf: value, hf: other})
    assert getattr(_model({mf: value, hf: value}), hf) == value  # agreeing twice is fine


def test_yarn_given_in_both_styles_must_agree():
    hf = dict(type="yarn", factor=4, original_max_position_embeddings=256, beta_fast=32, beta_slow=1,
              mscale=1, mscale_all_dim=1)
    same = {"rope_scaling": hf, "position_embedding_type": "yarn", "rotary_scaling_factor": 4,
            "max_position_embeddings": 256, "mscale": 1, "mscale_all_dim": 1}
    assert _model(same).rope_scaling == hf
    with pytest.raises(ConfigError, match="^model.position_embedding_type: gives rope_scaling"):
        _model({**same, "rotary_scaling_factor": 8})
    with pytest.raises(ConfigError, match="^model.beta_fast: is a YaRN setting; it needs position_embedding_type"):
        _model({"beta_fast": 32})


@pytest.mark.parametrize("field, value", [
    ("scoring_func", "softmax"), ("moe_router_score_function", "softmax"), ("multi_latent_attention", False),
    ("gated_linear_unit", False), ("add_bias_linear", True), ("normalization", "LayerNorm"),
    ("topk_method", "greedy"), ("moe_router_load_balancing_type", "aux_loss"),
    ("moe_token_dispatcher_type", "alltoall_deredundancy"), ("position_embedding_type", "learned_absolute"),
])
def test_values_that_are_another_model_are_refused(field, value):
    with pytest.raises(ConfigError, match=rf"^model\.{field}: .* is not supported"):
        _model({field: value})


def test_qk_layernorm_false_builds_without_the_latent_norms():
    # MindFormers' MLA takes IdentityOp for q_layernorm / kv_layernorm when it is false
    assert _model({"qk_layernorm": False}).qk_layernorm is False
    assert _model({"multi_latent_attention": True}).qk_layernorm is True  # left out: DeepSeek-V3's norms


def test_shared_expert_size_must_match_and_dropout_is_a_probability():
    with pytest.raises(ConfigError, match="^model.moe_shared_expert_intermediate_size: 100 must equal"):
        _model({"n_shared_experts": 1, "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 100})
    for name in ("hidden_dropout", "attention_dropout"):
        assert getattr(load_config(TINY_PATH, [f"model.{name}=0.1"]).model, name) == 0.1
        for bad in ("1.0", "-0.1"):
            with pytest.raises(ConfigError, match=rf"^model\.{name}: must be a probability in \[0, 1\)"):
                load_config(TINY_PATH, [f"model.{name}={bad}"])
    # attention dropout under Ulysses context parallelism is built (issue 34), and recomputing
    # the attention core with it (whole layers, or the core alone)
    for rc in (["recompute.mode=full"], ["recompute.mode=select", "recompute.select_module={self_attn.core_attention: true}"]):
        for method in (["parallelism.context_parallel_method=ulysses"],
                       ["parallelism.context_parallel_method=hybrid", "parallelism.ulysses_degree_in_cp=2"]):
            cfg = load_config(TINY_PATH, ["parallelism.context_parallel=4"] + method + rc, world_size=4)
            assert cfg.recompute.mode == rc[0].split("=")[1]
    assert load_config(TINY_PATH, ["model.attention_dropout=0.1", "parallelism.context_parallel=2",
                                   "parallelism.context_parallel_method=ulysses"], world_size=2).model.attention_dropout == 0.1
    # DeepSeek-V4 has both (issue 32), its colossal context parallelism too; a bad rate is refused alike
    v4 = os.path.join(os.path.dirname(TINY_PATH), "pynative_ds4_tiny.yaml")
    m = load_config(v4, ["model.hidden_dropout=0.1", "model.attention_dropout=0.2", "parallelism.context_parallel=2",
                         "parallelism.data_parallel_shard=1"], world_size=2).model
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.2)
    with pytest.raises(ConfigError, match=r"^model\.attention_dropout: must be a probability in \[0, 1\)"):
        load_config(v4, ["model.attention_dropout=1.0"])


def test_style_conversion_round_trips():
    mf = restyle(TINY, "mindformers")
    assert mf["model"]["position_embedding_type"] == "yarn" and "rope_scaling" not in mf["model"]
    assert mf["model"]["params_dtype"] == "float32" and "aux_loss_alpha" not in mf["model"]
    back = restyle(mf, "hf")
    assert parse_config(back).model == parse_config(TINY).model
    assert [getattr(parse_config(mf).model, n) for n in STRUCTURE] == \
        [getattr(parse_config(TINY).model, n) for n in STRUCTURE]


# ----------------------------------------------------------------------------- start-up notes
def test_startup_notes_name_what_has_no_effect():
    mf = load_config(MF_PATH)
    cpu = startup_notes(mf, "CPU")
    assert all("\n" not in line for line in cpu)
    named = [line.split("=")[0] for line in cpu]
    for field in ("model.use_flash_attention", "model.moe_grouped_gemm", "model.bias_swiglu_fusion",
                  "model.mla_qkv_concat", "model.moe_token_drop_policy"):
        assert field in named, (field, cpu)
    assert "recompute.mode" not in named  # recompute acts (#16)
    ascend = [line.split("=")[0] for line in startup_notes(mf, "Ascend")]
    assert "model.use_flash_attention" not in ascend and "model.mla_qkv_concat" in ascend
    assert startup_notes(load_config(TINY_PATH), "CPU") == []  # nothing set that has no effect


@pytest.mark.parametrize("override, field", [
    ("train_dataset.numa_enable=true", "train_dataset.numa_enable"),
    ("checkpoint.load_balanced=true", "checkpoint.load_balanced"),
    ("parallelism.pipeline_parallel_overlap_p2p=true", "parallelism.pipeline_parallel_overlap_p2p"),
    ("parallelism.pipeline_parallel_p2p_transport=auto", "parallelism.pipeline_parallel_p2p_transport"),
    ("parallelism.enable_mc2=true", "parallelism.enable_mc2"),
    ("parallelism.expert_parallel_async_d2h=true", "parallelism.expert_parallel_async_d2h"),
    ("train_dataset.use_distribute_dataset=true", "train_dataset.use_distribute_dataset"),
    ("train_dataset.dataloader.python_multiprocessing=true", "train_dataset.dataloader.python_multiprocessing"),
    ("checkpoint.save_global_layout_cache=false", "checkpoint.save_global_layout_cache"),
    ("checkpoint.reshard_worker_num=2", "checkpoint.reshard_worker_num"),
    ("checkpoint.load_worker_number=4", "checkpoint.load_worker_number"),
    ("profiler.mstx=true", "profiler.mstx"),
    ("swap.enable=true", "swap.enable"),
    ("recompute_comm.enable=true", "recompute_comm.enable"),
])
def test_each_note_field(override, field):
    notes = startup_notes(load_config(TINY_PATH, [override]), "CPU")
    assert [line for line in notes if line.startswith(field + "=")], notes


@pytest.mark.parametrize("device", ["Ascend", "GPU"])
def test_swap_off_cpu_is_refused_in_one_line(device):
    """#16: activation offload is not built; on a device where it would mean something the
    config is refused (on CPU it is a start-up note: activations already live in host memory)."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY_PATH, ["swap.enable=true", f"context.device_target={device}"])
    text = str(err.value)
    assert text.startswith(f"swap.enable: activation offload to host is not built for {device}; set it to false "
                           "and use recompute") and "\n" not in text, text
    cpu = load_config(TINY_PATH, ["swap.enable=true", "context.device_target=CPU"])
    assert [n for n in startup_notes(cpu, "CPU") if n.startswith("swap.enable=true has no effect")]
    # no device_target: the trainer applies the same rule to the device it chose
    unset = load_config(TINY_PATH, ["swap.enable=true"])
    validate_device(unset, "CPU")
    with pytest.raises(ConfigError, match=r"^swap\.enable: "):
        validate_device(unset, device)
    validate_device(load_config(TINY_PATH), device)  # swap off: nothing to refuse
    offload = load_config(TINY_PATH, ["parallelism.cpu_offload=true"])
    validate_device(offload, "CPU")  # on CPU a start-up note: the shards are in host memory already
    assert [n for n in startup_notes(offload, "CPU") if n.startswith("parallelism.cpu_offload=true has no effect")]
    with pytest.raises(ConfigError, match=r"^parallelism\.cpu_offload: "):
        validate_device(offload, device)


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("overrides, start", [
    (["lora_config={target_modules: 'linear_qkv', lora_dropout: 1.0}"], "lora_config.lora_dropout: must be in [0, 1)"),
    (["lora_config={target_modules: ''}"], "lora_config.target_modules: is required"),
    (["lora_config={target_modules: 'linear_(qkv'}"], "lora_config.target_modules: 'linear_(qkv' is not a regex"),
    (["lora_config={target_modules: 'linear_qkv', lora_rank: 0}"], "lora_config.lora_rank: must be a positive integer"),
    (["lora_config={target_modules: 'linear_qkv'}", "optimizer.type=Muon", "optimizer.qk_clip_enabled=true"],
     "optimizer.qk_clip_enabled: QK-clip scales the query and key weights, which LoRA freezes"),
    (["parallelism.context_parallel_method=ring"], "parallelism.context_parallel_method: 'ring' is not a method"),
    (["parallelism.context_parallel_method=hybrid", "parallelism.context_parallel=4"],
     "parallelism.ulysses_degree_in_cp: hybrid context parallelism needs 1 < ulysses_degree_in_cp"),
    (["parallelism.context_parallel_method=hybrid", "parallelism.context_parallel=4", "parallelism.ulysses_degree_in_cp=4"],
     "parallelism.ulysses_degree_in_cp: hybrid context parallelism needs"),
    (["parallelism.context_parallel_method=ulysses", "parallelism.context_parallel=4", "parallelism.ulysses_degree_in_cp=2"],
     "parallelism.ulysses_degree_in_cp: Ulysses context parallelism runs over all 4"),
    (["parallelism.context_parallel_method=ulysses", "parallelism.context_parallel=8"],
     "parallelism.context_parallel: 8 Ulysses ranks must divide the num_attention_heads"),
    (["parallelism.moe_token_dispatcher_type=alltoall_deredundancy", "parallelism.expert_parallel=2"],
     "parallelism.npu_nums_per_device: 8: alltoall_deredundancy needs expert_parallel (2) to be a multiple"),
    (["parallelism.moe_token_dispatcher_type=broadcast"], "parallelism.moe_token_dispatcher_type: 'broadcast' is not"),
    (["parallelism.tensor_parallel=2", "parallelism.sequence_parallel=false"], "parallelism.sequence_parallel: must be true"),
    (["parallelism.expert_tensor_parallel=2"], "parallelism.expert_tensor_parallel: must be 1 (experts whole"),
])
def test_unbuilt_features_are_refused_in_one_line(overrides, start):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_PATH, overrides)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_accepted_parallel_forms():
    load_config(TINY_PATH, ["parallelism.sequence_parallel=true"])  # TP = 1
    hybrid = load_config(TINY_PATH, ["parallelism.context_parallel_method=hybrid", "parallelism.context_parallel=4",
                                     "parallelism.ulysses_degree_in_cp=2"])
    assert startup_notes(hybrid, "CPU") == []
    # MindFormers reads the degree only for ulysses / hybrid: a note, not an error
    colossal = load_config(TINY_PATH, ["parallelism.ulysses_degree_in_cp=2"])
    assert [n for n in startup_notes(colossal, "CPU") if n.startswith("parallelism.ulysses_degree_in_cp=2 has no effect")]
    load_config(TINY_PATH, ["parallelism.expert_tensor_parallel=1"])
    cfg = load_config(TINY_PATH, ["parallelism.tensor_parallel=2", "parallelism.expert_tensor_parallel=2",
                                  "parallelism.sequence_parallel=true"])
    assert cfg.parallelism.expert_tensor_parallel == 2


# ----------------------------------------------------------------------------- section forms
@pytest.mark.parametrize("overrides", [
    ["recompute.mode=full", "recompute.full_recompute_layer=[0-3]"],
    ["recompute.mode=full", "recompute.full_recompute_layer=[0, '2-3']"],
    ["recompute.mode=full", "recompute.full_recompute_layer='[0-2]'"],
    ["recompute.mode=select", "recompute.select_module={'self_attention.*': [0-3], 'mlp.experts': [1-2]}"],
    ["recompute_comm.enable=true", "recompute_comm.select_module=['layers.*.mlp']"],
    ["swap.enable=true", "swap.layer_swap=[{layers: [0-1], backward_prefetch: 1}]",
     "swap.op_swap=[{op_name: attention, layers: true}]"],
    ["profiler.start_step=3", "profiler.end_step=3"],
    ["monitor.train_state=true"],
    ["monitor.train_state.local_norm=[embedding, lm_head]"],
    ["monitor.moe_monitor.target_layers=[0, 2]", "monitor.moe_monitor.save_tokens_per_expert_interval=5"],
    ["callbacks=[{type: MyCallback, every: 3}]"],
])
def test_good_forms_load(overrides):
    load_config(TINY_PATH, overrides)


@pytest.mark.parametrize("overrides, start", [
    (["recompute.mode=partial"], "recompute.mode: must be one of None, full, select"),
    (["recompute.full_recompute_layer=['3-1']"], "recompute.full_recompute_layer: '3-1': a range \"a-b\" needs"),
    (["recompute.full_recompute_layer=[x]"], "recompute.full_recompute_layer: 'x' is not a layer id"),
    (["recompute.mode=full", "recompute.full_recompute_layer=[0-4]"],
     "recompute.full_recompute_layer: layer 4 does not exist: the model has layers 0-3"),
    (["recompute.mode=select"], "recompute.select_module: is required when recompute.mode is select"),
    (["recompute.select_module=5"], "recompute.select_module: must map module paths"),
    (["swap.layer_swap=[{backward_prefetch: 1}]"], "swap.layer_swap[0].layers: is required"),
    (["swap.op_swap=[{layers: [0]}]"], "swap.op_swap[0].op_name: is required"),
    (["swap.layer_swap=[{layers: [0], backward_prefetch: -1}]"], "swap.layer_swap[0].backward_prefetch:"),
    (["profiler.start_step=5", "profiler.end_step=3"], "profiler.start_step: 5 must be <= profiler.end_step (3)"),
    (["monitor.health_checkpoint.global_norm_skip_threshold=0"], "monitor.health_checkpoint.global_norm_skip_threshold: must be > 0"),
    (["monitor.health_checkpoint.global_norm_skip_time=0"], "monitor.health_checkpoint.global_norm_skip_time:"),
    (["monitor.moe_monitor.target_layers=0"], "monitor.moe_monitor.target_layers:"),
    (["monitor.train_state.device_norm=['']"], "monitor.train_state.device_norm:"),
    (["callbacks=[{every: 3}]"], "callbacks[0].type: is required"),
])
def test_bad_forms_are_one_line_errors(overrides, start):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_PATH, overrides)
    assert str(err.value).startswith(start), str(err.value)


# ----------------------------------------------------------------------------- dataset fields
REQUIRED = ["seq_length", "split", "eod", "pad", "create_compressed_eod_mask", "data_path"]


@pytest.mark.parametrize("name", REQUIRED)
def test_the_quick_starts_dataset_fields_are_required(name):
    raw = copy.deepcopy(TINY)
    del raw["train_dataset"]["dataloader"]["config"][name]
    with pytest.raises(ConfigError, match=rf"^train_dataset\.dataloader\.config\.{name}: (is )?required"):
        parse_config(raw)


# MindFormers' MegatronDatasetBuilder.init_gpt_dataset_config: self.config.get(name, default)
MINDFORMERS_DEFAULTS = {"seed": 1234, "eod_mask_loss": False, "reset_position_ids": False,
                        "create_attention_mask": True, "reset_attention_mask": False, "eod_pad_length": 128}


@pytest.mark.parametrize("name", sorted(MINDFORMERS_DEFAULTS))
def test_other_dataset_fields_default_as_mindformers_loader(name):
    raw = copy.deepcopy(TINY)
    config = raw["train_dataset"]["dataloader"]["config"]
    del config[name]
    if name == "create_attention_mask":  # True (MindFormers' default) needs the fifth column
        raw["train_dataset"]["dataloader"]["column_names"].append("attention_mask")
    got = getattr(parse_config(raw).train_dataset.dataloader.config, name)
    assert got == MINDFORMERS_DEFAULTS[name] and type(got) is type(MINDFORMERS_DEFAULTS[name])


def test_compressed_eod_mask_length_is_eod_pad_lengths_older_name():
    raw = copy.deepcopy(TINY)
    config = raw["train_dataset"]["dataloader"]["config"]
    del config["eod_pad_length"]
    config["compressed_eod_mask_length"] = 64
    assert parse_config(raw).train_dataset.dataloader.config.eod_pad_length == 64


def test_mind_dataset_needs_dataset_files_only():
    raw = copy.deepcopy(TINY)
    raw["train_dataset"]["dataloader"] = {"type": "MindDataset", "dataset_files": "train_dataset",
                                          "column_names": ["input_ids", "labels", "loss_mask", "position_ids"]}
    parse_config(raw)
    del raw["train_dataset"]["dataloader"]["dataset_files"]
    with pytest.raises(ConfigError, match="^train_dataset.dataloader.dataset_files: is required"):
        parse_config(raw)


# ----------------------------------------------------------------------------- legacy converter
# Our own static-graph config with every section and key that MindFormers' configs/deepseek3
# pretrain/finetune files use (values of our own, sized tiny).
LEGACY = """
seed: 7
output_dir: './out'
load_checkpoint: ''
load_ckpt_format: 'safetensors'
src_strategy_path_or_dir: ''
auto_trans_ckpt: False
only_save_strategy: False
resume_training: False
use_parallel: True
run_mode: 'train'
train_precision_sync: True
print_separate_loss: True
pretrained_model_dir: "/models/tiny-hf"
trainer: {type: CausalLanguageModelingTrainer, model_name: 'deepseekV3'}
runner_config: {epochs: 2, batch_size: 1, sink_mode: True, sink_size: 1}
optimizer: {type: AdamW, betas: [0.9, 0.95], eps: 1.e-8, weight_decay: 0.01, swap: True}
lr_schedule: {type: ConstantWarmUpLR, learning_rate: 1.e-4, lr_end: 1.e-4, warmup_lr_init: 0, warmup_steps: 2,
              total_steps: -1}
train_dataset: &train_dataset
  data_loader:
    type: BlendedMegatronDatasetDataLoader
    datasets_type: "GPTDataset"
    shuffle: False
    sizes: [64, 0, 0]
    config:
      seed: 1234
      split: "1, 0, 0"
      seq_length: 256
      eod_mask_loss: False
      reset_position_ids: False
      create_attention_mask: False
      reset_attention_mask: False
      create_compressed_eod_mask: False
      eod_pad_length: 128
      eod: 1
      pad: -1
      num_dataset_builder_threads: 1
      data_path: ['1', "/data/tiny_text_document"]
  num_parallel_workers: 2
  python_multiprocessing: False
  drop_remainder: True
  numa_enable: False
  prefetch_size: 1
  seed: 1234
train_dataset_task: {type: CausalLanguageModelDataset, dataset_config: *train_dataset}
context:
  mode: 0
  device_target: "Ascend"
  max_call_depth: 10000
  max_device_memory: "58GB"
  mempool_block_size: "58GB"
  memory_optimize_level: "O0"
  save_graphs: False
  save_graphs_path: "./graph"
  jit_config: {jit_level: "O0"}
parallel_config:
  data_parallel: 1
  model_parallel: 2
  pipeline_stage: 2
  expert_parallel: 1
  micro_batch_num: 2
  use_seq_parallel: True
  gradient_aggregation_group: 4
micro_batch_interleave_num: 1
parallel:
  parallel_mode: 1
  gradients_mean: False
  enable_alltoall: True
  search_mode: "sharding_propagation"
  enable_parallel_optimizer: True
  pipeline_config: {pipeline_interleave: True, pipeline_scheduler: seqpipe}
  strategy_ckpt_config: {save_file: "./ckpt_strategy.ckpt", only_trainable_params: False}
  parallel_optimizer_config: {gradient_accumulation_shard: False, parallel_optimizer_threshold: 64,
                              optimizer_weight_shard_size: 2}
recompute_config: {recompute: True, select_recompute: False, mp_comm_recompute: True}
use_legacy: False
model:
  model_config:
    model_type: "deepseek_v3"
    architectures: ["DeepseekV3ForCausalLM"]
    offset: [[0, 0], [0, 1]]
    pp_interleave_num: 2
    seq_length: 256
    num_hidden_layers: 5
    vocab_size: 512
    hidden_size: 128
    intermediate_size: 256
    max_position_embeddings: 256
    hidden_act: 'silu'
    num_attention_heads: 4
    rms_norm_eps: 1.e-6
    add_bias_linear: False
    use_flash_attention: True
    use_attn_mask_compression: True
    multi_latent_attention: True
    mla_qkv_concat: False
    kv_lora_rank: 32
    q_lora_rank: 64
    qk_rope_head_dim: 16
    v_head_dim: 32
    qk_nope_head_dim: 32
    qk_layernorm: True
    attention_dropout: 0.0
    hidden_dropout: 0.0
    params_dtype: "float32"
    compute_dtype: "bfloat16"
    layernorm_compute_dtype: "float32"
    softmax_compute_dtype: "float32"
    rotary_dtype: "float32"
    initializer_range: 0.01
    num_nextn_predict_layers: 1
    mtp_loss_factor: 0.3
    position_embedding_type: "yarn"
    scaling_factor: 4
    beta_fast: 32
    beta_slow: 1
    mscale: 1
    mscale_all_dim: 1
    rope_theta: 10000
    apply_rope_fusion: False
    bias_swiglu_fusion: False
    router_dense_type: "float32"
    gated_linear_unit: True
    moe_grouped_gemm: True
    use_fused_ops_topkrouter: True
    n_group: 4
    topk_group: 2
    use_pad_tokens: False
    moe_token_dispatcher_type: "alltoall"
    moe_intermediate_size: 64
    routed_scaling_factor: 1.5
    first_k_dense_replace: 1
    n_routed_experts: 8
    num_experts_per_tok: 2
    n_shared_experts: 1
    moe_shared_expert_intermediate_size: 64
    moe_router_load_balancing_type: 'seq_aux_loss'
    moe_aux_loss_coeff: 0.001
    scoring_func: 'sigmoid'
    norm_topk_prob: True
    moe_token_drop_policy: probs
    moe_router_enable_expert_bias: True
    moe_router_bias_update_rate: 0.001
callbacks:
  - type: MFLossMonitor
  - type: TopkBiasBalanceCallback
  - type: CheckpointMonitor
    prefix: "tiny"
    save_checkpoint_steps: 10
    keep_checkpoint_max: 2
    integrated_save: False
    async_save: False
    checkpoint_format: "safetensors"
runner_wrapper: {type: MFTrainOneStepCell, scale_sense: 1.0, use_clip_grad: True}
profile: False
profile_start_step: 2
profile_stop_step: 3
init_start_profile: False
profile_communication: False
profile_memory: True
"""


def _convert(tmp_path, text, *flags):
    src, out = tmp_path / "legacy.yaml", tmp_path / "eager.yaml"
    src.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "mindtrain.config.convert", str(src), str(out), *flags],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, str(out)


def test_legacy_config_converts_completely(tmp_path):
    notes, out = _convert(tmp_path, LEGACY)
    cfg = load_config(out, world_size=4)
    # every legacy top-level key and section key is moved or named as dropped
    raw, written = yaml.safe_load(LEGACY), yaml.safe_load(open(out))
    for key, value in raw.items():
        assert f"\n  {key}" in "\n" + notes or f" {key}." in notes or f"dropped {key}" in notes, key
        same_place = {"lr_schedule": "lr_scheduler", "context": "context", "optimizer": "optimizer"}
        if isinstance(value, dict) and key not in ("model", "train_dataset", "train_dataset_task", "trainer",
                                                   "runner_wrapper"):
            for sub in value:
                kept = sub in (written.get(same_place.get(key), {}) or {})
                assert f"{key}.{sub}" in notes or kept, (key, sub)
    assert cfg.training.seed == 7 and cfg.training.deterministic is True
    assert cfg.training.local_batch_size == 1 and cfg.training.global_batch_size == 2  # x micro-batches
    assert cfg.training.steps == 2 * 64 // 2  # epochs x train samples / global batch
    assert cfg.checkpoint.load_path == "/models/tiny-hf" and cfg.checkpoint.save_path == "./out/checkpoint"
    assert (cfg.checkpoint.prefix, cfg.checkpoint.save_interleaved_steps, cfg.checkpoint.save_max) == ("tiny", 10, 2)
    assert cfg.checkpoint.enable_save and cfg.checkpoint.remove_redundancy
    p = cfg.parallelism
    assert (p.data_parallel_shard, p.tensor_parallel, p.pipeline_parallel, p.sequence_parallel) == (1, 2, 2, True)
    assert p.pipeline_parallel_interleave_num == 2 and p.pipeline_parallel_microbatch_size == 2
    assert p.pipeline_parallel_layers_per_stage == [1, 1, 1, 2]  # 5 // 4 + offset, virtual-stage order
    assert p.disable_gradient_division is True
    assert cfg.recompute.mode == "full" and cfg.recompute_comm.enable is True
    assert (cfg.profiler.enable_profiling, cfg.profiler.start_step, cfg.profiler.end_step) == (False, 2, 3)
    assert cfg.context.mode == 1 and cfg.context.max_device_memory == "58GB"
    assert cfg.lr_scheduler.warmup_steps == 2 and cfg.lr_scheduler.lr_end == 0.0
    assert cfg.train_dataset.dataloader.config.num_dataset_builder_threads == 1
    m = cfg.model
    assert m.rope_scaling["factor"] == 4 and m.mtp_loss_scaling_factor == 0.3 and m.routed_scaling_factor == 1.5
    assert "dropped optimizer.swap:" in notes and "dropped callbacks[0] (MFLossMonitor):" in notes


def test_legacy_hf_dataloader_gets_a_placeholder_and_style_applies(tmp_path):
    text = LEGACY.replace("""    type: BlendedMegatronDatasetDataLoader
    datasets_type: "GPTDataset"
""", """    type: HFDataLoader
    load_func: 'load_dataset'
    path: "some/dataset"
    handler: [{type: take, n: 8}]
""")
    notes, out = _convert(tmp_path, text, "--style", "hf")
    assert "dropped train_dataset.data_loader (HFDataLoader): Hugging Face datasets are not read" in notes
    cfg = load_config(out, world_size=4)
    written = yaml.safe_load(open(out))["model"]
    assert "rope_scaling" in written and "position_embedding_type" not in written
    assert cfg.train_dataset.dataloader.config.data_path[1] == "/path/to/your_dataset_text_document"
