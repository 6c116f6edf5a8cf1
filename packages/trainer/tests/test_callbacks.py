"""callbacks: config entries resolved from the registry; a user class from --register_path
sees every step."""

import pytest

from mindtrain.config import ConfigError
from mindtrain.config.schema import CallbackConfig
from mindtrain.trainer.callbacks import build_callbacks
from mindtrain.trainer.registry import load_register_path
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

USER_MODULE = '''
from mindtrain.trainer.callbacks import TrainerCallback
from mindtrain.trainer.registry import register

SEEN = []


@register("callback", "StepRecorder")
class StepRecorder(TrainerCallback):
    def __init__(self, tag, every=1):
        self.tag = tag
        self.every = every

    def on_train_begin(self, args, state, **kwargs):
        SEEN.append((self.tag, "begin", state.global_step, args.training.steps))

    def on_step_begin(self, args, state, **kwargs):
        SEEN.append((self.tag, "step_begin", state.global_step))

    def on_step_end(self, args, state, **kwargs):
        SEEN.append((self.tag, "step_end", state.global_step, state.consumed_samples, kwargs["loss"],
                     kwargs["model"] is not None))

    def on_train_end(self, args, state, **kwargs):
        SEEN.append((self.tag, "end", state.global_step))
'''


def test_user_callback_from_register_path_sees_every_step(tiny_config, tmp_path):
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "mt_test_step_recorder.py").write_text(USER_MODULE)
    assert load_register_path(str(folder)) == ["mt_test_step_recorder"]
    import mt_test_step_recorder as user

    cfg = tiny_config("training.steps=2", "callbacks=[{type: StepRecorder, tag: run1, every: 1}]")
    history = Trainer(cfg, Runtime(device="CPU"), out=lambda _: None).train()
    assert user.SEEN == [
        ("run1", "begin", 0, 2),
        ("run1", "step_begin", 0), ("run1", "step_end", 1, 2, history[0]["loss"], True),
        ("run1", "step_begin", 1), ("run1", "step_end", 2, 4, history[1]["loss"], True),
        ("run1", "end", 2)]


def test_unknown_type_and_bad_arguments_are_one_line_errors():
    with pytest.raises(ConfigError) as err:
        build_callbacks([CallbackConfig(type="NoSuchCallback")])
    msg = str(err.value)
    assert msg.startswith("callbacks[0].type: callback 'NoSuchCallback' is not registered")
    assert "registered: " in msg and "MaxLogitsMonitor" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"^callbacks\[0\]\.type: is missing"):
        build_callbacks([CallbackConfig(type="")])
    with pytest.raises(ConfigError, match=r"^callbacks: MaxLogitsMonitor step_interval must be a positive int"):
        build_callbacks([CallbackConfig(type="MaxLogitsMonitor", params={"step_interval": 0})])
