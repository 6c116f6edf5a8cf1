"""MindFormers' published DeepSeek-V4 system-test config (fixtures/mindformers/pynative_deepseek4.yaml,
verbatim): its model section loads unchanged into DeepSeek-V4's mla variant; the whole file
loads as published but for the data path; what the CPU cannot honour is a start-up note."""

import os

import pytest
import yaml

from mindtrain.config import ConfigError, ModelConfig, validate_model
from mindtrain.config.families import moe_layer_ids
from mindtrain.config.loader import from_dict, load_config
from mindtrain.config.startup_notes import startup_notes

HERE = os.path.dirname(os.path.abspath(__file__))
DS4 = os.path.join(HERE, "fixtures", "mindformers", "pynative_deepseek4.yaml")


def _model(**change):
    with open(DS4, encoding="utf-8") as f:
        raw = yaml.safe_load(f)["model"]
    raw.update(change)
    return from_dict(ModelConfig, raw, "model")


def test_model_section_loads_as_published():
    m = _model()
    validate_model(m)
    assert m.model_type == "deepseek_v4" and m.experimental_attention_variant == "mla"
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim) == (512, 1536, 64,
                                                                                                       128, 128)
    assert m.enable_hyper_connections and not m.enable_hc_head and m.hc_mult == 4 and m.hc_sinkhorn_iters == 0
    assert (m.num_hash_layers, m.scoring_func, m.routed_scaling_factor) == (3, "sigmoid", 2.5)
    assert (m.num_nextn_predict_layers, m.mtp_loss_scaling_factor) == (1, 0.3)
    assert (m.aux_loss_alpha, m.bias_update_speed) == (0.002, 0.002)  # moe_aux_loss_coeff, ..._bias_update_rate
    assert m.rope_scaling["type"] == "yarn" and m.hidden_act == "silu"
    assert moe_layer_ids(m) == list(range(17))  # 16 layers and the MTP module


def test_whole_file_loads_as_published(tmp_path):
    """Muon with QK-clip (MLA), MindFormers' recompute module patterns, MindDataset, TP=2 x
    EP=2 x PP=2 (2-way interleaved) x FSDP 2 with its default ZeRO-3 (MTP included): as
    published but for the data path, it loads."""
    with open(DS4, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    (tmp_path / "train_dataset").mkdir()
    raw["train_dataset"]["dataloader"]["dataset_files"] = str(tmp_path / "train_dataset")
    path = tmp_path / "ds4.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_config(str(path))
    p = cfg.parallelism
    assert (p.tensor_parallel, p.expert_parallel, p.pipeline_parallel, p.data_parallel_shard) == (2, 2, 2, 2)
    assert p.data_parallel_shard_strategy == "optim_grads_params"
    assert cfg.optimizer.type == "Muon" and cfg.optimizer.qk_clip_enabled
    notes = startup_notes(cfg, "CPU")
    for field in ("optimizer.use_fused_adamw", "model.moe_grouped_gemm", "model.use_flash_attention"):
        assert any(n.startswith(field + "=") for n in notes), (field, notes)
    cfg.model.expert_dtype = "fp4"
    assert any(n.startswith("model.expert_dtype=fp4 has no effect") for n in startup_notes(cfg, "CPU"))


@pytest.mark.parametrize("change, field", [
    (dict(multi_latent_attention=False), "multi_latent_attention"),
    (dict(experimental_attention_variant="dsa"), "experimental_attention_variant"),
    (dict(enable_hyper_connections=False, enable_hc_head=True), "enable_hc_head"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(moe_router_pre_softmax="yes"), "moe_router_pre_softmax"),
])
def test_v4_mistakes_are_one_line(change, field):
    with pytest.raises(ConfigError) as err:
        validate_model(_model(**change))
    assert str(err.value).startswith(f"model.{field}") and "\n" not in str(err.value)


def test_qk_layernorm_false_is_built():
    # MindFormers: IdentityOp q_layernorm / kv_layernorm (issue 34; was refused); the hybrid
    # variant's: packages/models/tests/test_deepseek_v4_no_qk_norm.py
    m = _model(qk_layernorm=False)
    validate_model(m)
    assert m.qk_layernorm is False


def test_qk_clip_needs_mla_attention(tmp_path):
    """QK-clip scales MLA weights: V4's mla variant takes it, the hybrid attention does not."""
    from mindtrain.config.validate import _validate_max_logits

    with open(DS4, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    (tmp_path / "d").mkdir()
    raw["train_dataset"]["dataloader"]["dataset_files"] = str(tmp_path / "d")
    path = tmp_path / "ds4.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    cfg = load_config(str(path))
    _validate_max_logits(cfg)
    cfg.model.experimental_attention_variant = "dsv4_hybrid"
    with pytest.raises(ConfigError) as err:
        _validate_max_logits(cfg)
    assert str(err.value).startswith("optimizer.qk_clip_enabled")
