"""optimizer.type: Muon in the Trainer: a run resumed from step 2 equals the run that went on,
in both checkpoint layouts (mindtrain's and MindFormers', whose files name the buffers
muon_m.<MindFormers name>)."""

import pytest
from safetensors.numpy import load_file

from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

MUON = ["optimizer.type=Muon", "optimizer.weight_decay=0.1", "optimizer.momentum=0.9",
        "optimizer.ns_coefficients=[[[3.4445, -4.7750, 2.0315], 3], [[2.0, -1.5, 0.5], 2]]",
        "lr_scheduler.learning_rate=0.01"]


@pytest.mark.parametrize("layout", ["mindtrain", "mindformers"])
def test_muon_resume_is_exact(tiny_config, tmp_path, layout):
    save = [f"checkpoint.layout={layout}", "checkpoint.enable_save=true", "checkpoint.save_interval=2"]
    cfg = tiny_config(*MUON, *save, f"checkpoint.save_path={tmp_path}/a")
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lambda _: None)
    assert type(trainer.optimizer).__name__ == "Muon" and trainer.optimizer.muon_idx and trainer.optimizer.adamw_idx
    full = trainer.train()
    assert full[-1]["loss"] < full[0]["loss"]
    folder = "iter_0000002" if layout == "mindtrain" else "iteration_00000002"
    resumed = Trainer(tiny_config(*MUON, *save, f"checkpoint.save_path={tmp_path}/b",
                                  f"checkpoint.load_path={tmp_path}/a/{folder}"),
                      Runtime(device="CPU"), out=lambda _: None).train()
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "grad_norm", "lr"):
        assert resumed[0][key] == full[2][key], key
    last = "iter_0000003" if layout == "mindtrain" else "iteration_00000003"
    a, b = (tmp_path / d / last for d in ("a", "b"))
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert sorted(ta) == sorted(tb)
        for k in ta:
            assert (ta[k] == tb[k]).all(), (f, k)
    names = {k for f in a.glob("*.safetensors") for k in load_file(str(f))}
    assert any(k.startswith("muon_m.") for k in names)
    if layout == "mindformers":  # MindFormers' names: its Muon buffers, AdamW moments of the embedding
        assert "muon_m.decoder.layers.0.self_attention.linear_qkv.weight" in names
        assert "adam_m.embedding.word_embeddings.weight" in names
        assert not any(k.startswith("adam_m.decoder.layers.0.self_attention.linear_qkv") for k in names)
