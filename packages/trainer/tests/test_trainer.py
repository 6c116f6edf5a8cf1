"""The Trainer in one process on the tiny config: exact resume, HF start, non-finite steps."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mindtrain.models import is_compiled
from mindtrain.trainer.export_hf import export_hf
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import NonFiniteError, Trainer


@pytest.fixture
def tiny64(tiny_config):
    """``tiny64(*overrides)``: the tiny config (conftest's) at seq 64 with the default compiled
    layers: resume and the HF start must reach the buffers the compiled layers read."""
    return lambda *extra: tiny_config("model.seq_length=64", "train_dataset.dataloader.config.seq_length=64",
                                      "compile.enable=true", *extra)


def test_resume_is_exact_and_checkpoint_is_an_hf_directory(tiny64, tmp_path):
    lines = []
    cfg = tiny64("checkpoint.enable_save=true", f"checkpoint.save_path={tmp_path}/ck",
                 "checkpoint.save_interval=2")
    full = Trainer(cfg, Runtime(device="CPU"), out=lines.append).train()
    assert [r["step"] for r in full] == [1, 2, 3] and full[-1]["loss"] < full[0]["loss"]
    assert len([x for x in lines if x.startswith("{ step:")]) == 3
    # the config's bfloat16 compute has no CPU matmul kernel: said once, then float32
    notes = [x for x in lines if "compute_dtype" in x]
    assert len(notes) == 1 and "bfloat16" in notes[0] and notes[0].endswith("computing in float32"), notes

    cfg2 = tiny64(f"checkpoint.load_path={tmp_path}/ck/iter_0000002")
    resumed = Trainer(cfg2, Runtime(device="CPU"), out=lines.append).train()
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "grad_norm", "load_balancing_loss", "mtp_loss", "lr"):
        assert resumed[0][key] == full[2][key], key

    # the sharded checkpoint exports to an HF model directory (config.json + HF-named safetensors)
    folder = tmp_path / "ck" / "iter_0000003"
    assert sorted(os.listdir(folder)) == ["config.json", "metadata.json", "model-0000000-0000001.safetensors",
                                          "opt-0000000-0000001.safetensors", "rank_00000.json", "trainer_state.json"]
    export_hf(str(folder), str(tmp_path / "hf"))
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v3" and hf["num_hidden_layers"] == 2
    names = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    metrics = [json.loads(x) for d in os.listdir(tmp_path / "metrics")
               for x in open(tmp_path / "metrics" / d / "metrics.jsonl")]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "per_step_time_ms", "max_rss_mb"} <= set(metrics[0])


def test_hf_start_and_non_finite_steps_stop_the_run(tiny64, tmp_path):
    cfg = tiny64("checkpoint.enable_save=true", f"checkpoint.save_path={tmp_path}/ck",
                 "training.steps=1")
    Trainer(cfg, Runtime(device="CPU"), out=lambda _: None).train()
    hf = tmp_path / "hf"
    export_hf(str(tmp_path / "ck" / "iter_0000001"), str(hf))
    weights = load_file(str(hf / "model.safetensors"))
    lines = []
    start = Trainer(tiny64(f"checkpoint.load_path={hf}", "training.steps=1"),
                    Runtime(device="CPU"), out=lines.append)
    assert start.step == 0 and any("HF model directory" in x for x in lines)
    got = {n: p.asnumpy() for n, p in start.model.parameters_and_names()}
    np.testing.assert_array_equal(got["model.norm.weight"], weights["model.norm.weight"])

    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    save_file(weights, str(hf / "model.safetensors"))
    bad = Trainer(tiny64(f"checkpoint.load_path={hf}", "training.max_skipped_steps=2"),
                  Runtime(device="CPU"), out=lines.append)
    before = bad.model.model.layers[0].self_attn.q_a_proj.weight.asnumpy().copy()
    with pytest.raises(NonFiniteError, match="training.max_skipped_steps: 2 steps in a row"):
        bad.train()
    assert bad.skips.skipped_total == 2 and bad.optimizer.step_count == 0
    np.testing.assert_array_equal(bad.model.model.layers[0].self_attn.q_a_proj.weight.asnumpy(), before)


def test_compile_switch_changes_the_speed_not_the_figures(tiny_config):
    """compile.enable (default true) builds the model with compiled layers; false, eager; the
    two runs print the same figures."""
    runs = {}
    for enable in (True, False):
        trainer = Trainer(tiny_config("training.steps=2", f"compile.enable={str(enable).lower()}"),
                          Runtime(device="CPU"), out=lambda _line: None)
        assert is_compiled(trainer.model) is enable
        runs[enable] = [[r[k] for k in ("loss", "load_balancing_loss", "mtp_loss", "grad_norm")]
                        for r in trainer.train()]
    np.testing.assert_allclose(runs[False], runs[True], rtol=1e-6)


V4_VARIANTS = {  # the tiny config's hybrid attention; the mla variant with an MTP module (2 layers: hash
    # routing, then learned); fewer Sinkhorn iterations than the config's 20 (the same code, less time)
    "dsv4_hybrid": ["model.hc_sinkhorn_iters=4"],
    "mla_mtp": ["model.experimental_attention_variant=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
                "model.v_head_dim=16", "model.num_nextn_predict_layers=1", "model.num_hidden_layers=2",
                "model.hc_sinkhorn_iters=4"],
}


@pytest.mark.parametrize("variant", list(V4_VARIANTS))
def test_deepseek_v4_trains_in_one_process_and_resumes_in_the_mindformers_layout(tiny_data, tmp_path, variant):
    """configs/pynative_ds4_tiny.yaml (sliding, compressed sparse and heavily compressed layers,
    hash and learned routing, hyper-connection streams; or the mla variant with an MTP module)
    trains through the Trainer: finite losses and gradient norms, each step's record. It saves
    each step in MindFormers' layout (checkpoint.layout: mindformers); resumed from step 1, step
    2 has the uninterrupted run's figures and its checkpoint equals the uninterrupted run's bit
    for bit (weights, hash tables, moments)."""
    from mindtrain.config import load_config
    from mindtrain.trainer import mindformers_checkpoint as mf

    def config(*extra):
        return load_config(os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "pynative_ds4_tiny.yaml"),
                           ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "training.steps=2",
                            "training.local_batch_size=2", "compile.enable=false", f"train_dataset.dataloader.config.data_path=['1', '{tiny_data}']",
                            f"monitor.metrics_dir={tmp_path}/metrics", "checkpoint.layout=mindformers",
                            "checkpoint.prefix=ds4", "checkpoint.enable_save=true", "checkpoint.save_interval=1",
                            *V4_VARIANTS[variant], *extra])

    records = Trainer(config(f"checkpoint.save_path={tmp_path}/a"), Runtime(device="CPU"), out=lambda _line: None).train()
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) and 0 < r["grad_norm"] < 1e3 for r in records)
    first = tmp_path / "a" / mf.folder_name(1)
    resumed = Trainer(config(f"checkpoint.save_path={tmp_path}/b", f"checkpoint.load_path={first}"),
                      Runtime(device="CPU"), out=lambda _line: None).train()
    assert [r["step"] for r in resumed] == [2]
    for key in ("loss", "grad_norm", "load_balancing_loss", "mtp_loss", "lr", "consumed_samples"):
        assert resumed[0][key] == records[1][key], key
    a, b = (tmp_path / d / mf.folder_name(2) for d in ("a", "b"))
    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files == sorted(p.name for p in b.glob("*.safetensors")) == ["ds4-model-0000000-0000001.safetensors",
                                                                        "ds4-opt-0000000-0000001.safetensors"]
    for f in files:
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert sorted(ta) == sorted(tb)
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and (ta[k] == tb[k]).all(), (f, k)
    model = load_file(str(a / files[0]))
    assert model["decoder.layers.0.mlp.router.tid2eid"].dtype == np.int32 and "decoder.layers.0.ffn_hc.alpha_res" in model
    assert ("mtp.layers.0.eh_proj.weight" in model) == (variant == "mla_mtp")