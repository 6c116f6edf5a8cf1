"""Muon's QK-clip (``optimizer.qk_clip_enabled``): one Muon + QK-clip step on DeepSeek-V3's MLA
query/key projections equals torch.optim.Muon followed by a torch transcription of
MindFormers' clip rule (fixture from tools/make_qkclip_fixtures.py), with the max logits
mindtrain's attention recorded; and in the Trainer, clipping fires and a resume is exact."""

import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor
from safetensors.numpy import load_file

import mindtrain.models as mm
from mindtrain.config import OptimizerConfig
from mindtrain.models.attention import max_attention_logits, track_max_attention_logits
from mindtrain.models.hf_config import config_from_hf
from mindtrain.trainer.muon import Muon
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

ms.set_device("CPU")
ms.runtime.launch_blocking()

HERE = os.path.dirname(__file__)
FIXTURE = os.path.join(HERE, "fixtures", "qk_clip_torch.npz")
HF = os.path.join(HERE, "..", "..", "models", "tests", "fixtures")


@pytest.mark.parametrize("name", ["qlora", "noqlora"])
def test_one_step_matches_torch_muon_and_mindformers_clip(name):
    ref = np.load(FIXTURE)
    d = os.path.join(HF, f"hf_{name}")
    # the max logits: mindtrain's own attention, one forward of the fixture's batch
    model = mm.from_pretrained(d, jit=False)
    track_max_attention_logits(model)
    model(Tensor(load_file(os.path.join(d, "reference.safetensors"))["input_ids"]))
    table = max_attention_logits(model)
    threshold = float(ref[f"{name}.threshold"])
    tops = np.concatenate([table[i] for i in sorted(table)])
    assert 0 < (tops >= threshold).sum() < tops.size  # some heads clip, others do not

    weights = load_file(os.path.join(d, "model.safetensors"))
    names = sorted(k[len(f"{name}.grad."):] for k in ref.files if k.startswith(f"{name}.grad."))
    # the MLA's kv_a_proj_with_mqa tells Muon the weights are MLA's (its parts orthogonalised apart)
    extra = sorted(k for k in weights if k.endswith("self_attn.kv_a_proj_with_mqa.weight"))
    named = [(n, Parameter(Tensor(weights[n]), name=n)) for n in names + extra]
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        model_cfg = config_from_hf(json.load(f))
    cfg = OptimizerConfig(type="Muon", weight_decay=0.1, momentum=0.95, ns_steps=5, eps=1e-7,
                          matched_adamw_rms=0.2, qk_clip_enabled=True, qk_clip_threshold=threshold)
    opt = Muon(named, cfg, lr=0.02, model=model_cfg)
    assert all(i in opt.muon_idx for i in range(len(names)))
    grads = [Tensor(ref[f"{name}.grad.{n}"]) for n in names] + [Tensor(np.zeros_like(weights[n])) for n in extra]
    opt.step(grads)
    for n, p in named[:len(names)]:
        np.testing.assert_allclose(p.asnumpy(), ref[f"{name}.muon.{n}"], rtol=1e-5, atol=1e-6, err_msg=n)
    clipped = opt.qk_clip(table, threshold)
    assert clipped == int((tops >= threshold).sum())
    changed = 0
    for n, p in named[:len(names)]:
        want = ref[f"{name}.clipped.{n}"]
        np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-5, atol=1e-6, err_msg=n)
        changed += int(np.any(np.abs(want - ref[f"{name}.muon.{n}"]) > 1e-6))
    assert changed == len(names)  # every layer has a clipped head here
    print(f"{name}: {clipped}/{tops.size} heads clipped at threshold {threshold:.4f}")


QK = ["optimizer.type=Muon", "optimizer.weight_decay=0.1", "optimizer.momentum=0.9",
      "optimizer.qk_clip_enabled=true", "optimizer.qk_clip_threshold=0.1", "lr_scheduler.learning_rate=0.01"]


def test_trainer_clips_and_resume_is_exact(tiny_config, tmp_path):
    save = ["checkpoint.enable_save=true", "checkpoint.save_interval=2"]
    trainer = Trainer(tiny_config(*QK, *save, f"checkpoint.save_path={tmp_path}/a"), Runtime(device="CPU"),
                      out=lambda _: None)
    full = trainer.train()
    assert all(r["qk_clipped_heads"] > 0 for r in full)  # clipping is active at every step
    assert all(r["max_attention_logit"] > 0.1 for r in full)
    assert len(trainer.max_logits) == trainer.cfg.model.num_hidden_layers + trainer.cfg.model.num_nextn_predict_layers
    resumed = Trainer(tiny_config(*QK, *save, f"checkpoint.save_path={tmp_path}/b",
                                  f"checkpoint.load_path={tmp_path}/a/iter_0000002"),
                      Runtime(device="CPU"), out=lambda _: None).train()
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "grad_norm", "max_attention_logit", "qk_clipped_heads"):
        assert resumed[0][key] == full[2][key], key
    # the clip changes the weights: without it (a threshold no logit reaches) step 2 differs
    unclipped = Trainer(tiny_config(*QK, "optimizer.qk_clip_threshold=1e9", "training.steps=2"),
                        Runtime(device="CPU"), out=lambda _: None).train()
    assert unclipped[0]["loss"] == full[0]["loss"] and unclipped[0]["qk_clipped_heads"] == 0
    assert abs(unclipped[1]["loss"] - full[1]["loss"]) > 1e-6
    a, b = (tmp_path / d / "iter_0000003" for d in ("a", "b"))
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)


def test_max_logits_monitor_without_qk_clip(tiny_config, capsys):
    """MaxLogitsMonitor alone (AdamW): the model tracks its logits and the callback prints
    MindFormers' lines, one per layer (decoder layers and the MTP module), mean and max."""
    cfg = tiny_config("training.steps=1", "callbacks=[{type: MaxLogitsMonitor}]")
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lambda _: None)
    (rec,) = trainer.train()
    lines = [x for x in capsys.readouterr().out.splitlines() if "max_attention_logit/" in x]
    layers = cfg.model.num_hidden_layers + cfg.model.num_nextn_predict_layers
    assert len(lines) == layers + 2 and "qk_clipped_heads" not in rec
    assert lines[0].startswith("step:[    1/    1] max_attention_logit/model.layers.0.self_attn.core_attention."
                               "max_logits_val: [")
    top = max(float(v) for v in lines[-1].rsplit(":", 1)[1].split())
    assert abs(top - rec["max_attention_logit"]) < 1e-3 * rec["max_attention_logit"]
