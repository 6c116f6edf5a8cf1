"""monitor.tensorboard: event files written during training, read back with TensorBoard's
own reader."""

import math
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer


def test_training_writes_tensorboard_scalars(tiny_config, tmp_path):
    tb = tmp_path / "tb"
    cfg = tiny_config("training.steps=3", f"monitor.tensorboard.tensorboard_dir={tb}",
                      "monitor.tensorboard.log_interval=2", "monitor.train_state.local_norm=embed_tokens")
    history = Trainer(cfg, Runtime(device="CPU"), out=lambda _: None).train()
    assert any(f.startswith("events.out.tfevents.") for f in os.listdir(tb))
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "learning-rate", "grad-norm", "throughput", "iteration-time", "batch-size",
            "load-balancing-loss", "mtp-1-loss", "local-norm/model.embed_tokens.weight", "loss_vs_samples"} <= tags
    assert not any(t.startswith("device-norm/") for t in tags)  # train_state asked for local norms only
    by_step = {r["step"]: r for r in history}
    for tag, key, scale in (("loss", "loss", 1.0), ("grad-norm", "grad_norm", 1.0), ("learning-rate", "lr", 1.0),
                            ("throughput", "throughput_flops", 1e-12)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [2], tag  # every log_interval steps
        for e in events:
            assert math.isclose(e.value, by_step[e.step][key] * scale, rel_tol=1e-5), (tag, e.step)
    assert [e.step for e in acc.Scalars("loss_vs_samples")] == [4]  # consumed samples
    assert all(e.value > 0 for e in acc.Scalars("local-norm/model.embed_tokens.weight"))
    # the config as text, one entry per section
    assert any("model" in t for t in acc.Tags().get("tensors", []))


def test_settings_are_checked(tmp_path):
    import pytest

    from mindtrain.config import ConfigError
    from mindtrain.trainer.tensorboard import TensorBoardWriter

    with pytest.raises(ConfigError, match=r"^monitor.tensorboard.log_interval: is 0; give a positive integer"):
        TensorBoardWriter(str(tmp_path / "tb"), log_interval=0)
    assert not (tmp_path / "tb").exists()
