"""The validation loop in one process: what it evaluates, that it changes no training figure,
its log line and metrics, and its one-line errors. Its equality with one process in every
layout is in integration_tests/test_trainer_layouts.py."""

import json
import math
import os

import numpy as np
import pytest
from mindspore import Tensor

from mindtrain.config import ConfigError
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

EVAL = ("validation.enable=true", "validation.freq=2", "validation.steps=2",
        "train_dataset.dataloader.config.split='90, 10, 0'")


def _reference_loss(cfg, model, data=None) -> float:
    """The mean LM loss of the first 2 global batches of ``data`` (default: the validation
    split, read with the data package), run through the model's own call, micro-batch by
    micro-batch."""
    from mindtrain.data import build_dataset

    t = cfg.training
    if data is None:
        data = build_dataset(cfg.train_dataset, "valid", num_samples=2 * t.global_batch_size)
    losses = []
    for start in range(0, 2 * t.global_batch_size, t.local_batch_size):
        rows = [data[i] for i in range(start, start + t.local_batch_size)]
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        _, metrics = model(Tensor(batch["input_ids"]), labels=Tensor(batch["labels"]),
                           loss_mask=Tensor(batch["loss_mask"]), position_ids=Tensor(batch["position_ids"]))
        losses.append(float(metrics["lm_loss"].asnumpy()))
    model.take_expert_load()
    return float(np.mean(losses))


def test_validation_evaluates_the_split_and_changes_no_training_figure(tiny_config, tmp_path):
    lines = []
    cfg = tiny_config(*EVAL, "training.steps=2", "validation.freq=1", f"monitor.tensorboard.output_dir={tmp_path}/tb")
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lines.append)
    history = trainer.train()
    evaluated = [r for r in history if "validation_loss" in r]
    assert [r["step"] for r in evaluated] == [1, 2]
    assert evaluated[-1]["validation_samples"] == 2 * cfg.training.global_batch_size
    want = _reference_loss(cfg, trainer.model)  # the weights after step 2, as the last evaluation saw them
    assert abs(evaluated[-1]["validation_loss"] - want) <= 1e-6 * abs(want), (evaluated[-1], want)
    assert evaluated[-1]["validation_ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    shown = [x for x in lines if x.startswith("validation: { step:[")]
    assert len(shown) == 2 and "perplexity:" in shown[-1] and f"{want:10.6f}" in shown[-1], shown
    (run,) = os.listdir(tmp_path / "metrics")
    rows = [json.loads(x) for x in open(tmp_path / "metrics" / run / "metrics.jsonl")]
    assert [r["step"] for r in rows if "validation_loss" in r] == [1, 2]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, key in (("lm-loss-validation", "validation_loss"), ("lm-loss-validation-ppl", "validation_ppl")):
        events = acc.Scalars(tag)  # Megatron's tags
        assert [e.step for e in events] == [1, 2], tag
        assert [e.value for e in events] == pytest.approx([r[key] for r in evaluated], rel=1e-6), tag

    plain = Trainer(tiny_config("train_dataset.dataloader.config.split='90, 10, 0'", "training.steps=2"),
                    Runtime(device="CPU"), out=lambda _: None).train()
    for key in ("loss", "grad_norm", "load_balancing_loss", "mtp_loss"):
        assert [r[key] for r in plain] == [r[key] for r in history], key


@pytest.mark.parametrize("override, field", [
    ("validation.steps=0", "validation.steps"),
    ("validation.freq=0", "validation.freq"),
    ("validation.split=eval", "validation.split"),
    ("train_dataset.dataloader.config.split='1, 0, 0'", "validation.split"),
    ("validation.data_path=[]", "validation.data_path"),
])
def test_bad_validation_settings_name_their_field(tiny_config, override, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(*EVAL, override)
    assert str(err.value).startswith(field), str(err.value)


def test_a_separate_eval_dataset(tiny_config, tiny_data):
    """validation.data_path: weighted prefixes need a batch count (one line); evaluated, its
    samples are those of the data package's dataset of that path alone."""
    with pytest.raises(ConfigError, match=r"^validation\.steps: -1"):
        tiny_config(*EVAL, f"validation.data_path=['1', '{tiny_data}']", "validation.steps=-1")
    cfg = tiny_config(*EVAL, f"validation.data_path=['1', '{tiny_data}']", "training.steps=2")
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lambda _: None)
    rec = trainer.train()[-1]
    from mindtrain.data import build_dataset

    section = cfg.train_dataset
    section.dataloader.config.split = "1, 0, 0"
    section.dataloader.sizes = [4, 0, 0]
    want = _reference_loss(cfg, trainer.model, build_dataset(section, "train", num_samples=4))
    assert rec["validation_samples"] == 4
    assert abs(rec["validation_loss"] - want) <= 1e-6 * abs(want), (rec, want)
