"""optimizer.type: Muon as MindFormers configures it: the optimizer section of its DeepSeek-V4
test config loads as published; bad values are one-line errors naming the field."""

import os

import pytest
import yaml

from mindtrain.config import ConfigError, OptimizerConfig, from_dict, load_config
from mindtrain.config.validate import _validate_muon, ns_schedule

HERE = os.path.dirname(__file__)
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DS4 = os.path.join(HERE, "fixtures", "mindformers", "pynative_deepseek4.yaml")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")


def _published():
    with open(DS4, encoding="utf-8") as f:
        return yaml.safe_load(f)["optimizer"]


def test_deepseek4_optimizer_section_loads_as_published():
    o = from_dict(OptimizerConfig, _published(), "optimizer")
    assert o.type == "Muon" and o.momentum == 0.95 and o.nesterov is True and o.matched_adamw_rms == 0.2
    assert o.adamw_betas == [0.9, 0.95] and o.adamw_eps == 1e-8 and o.use_fused_adamw is True
    assert o.adamw_include == ["*word_embeddings*", "*output_layer*"] and o.qk_clip_threshold == 100.0
    # the schedule sets the step count (8 + 2); ns_steps: 8 is ignored, as in MindFormers
    sched = ns_schedule(o)
    assert len(sched) == 10 and sched[0] == (3.4445, -4.7750, 2.0315) and sched[-1] == (2.0, -1.5, 0.5)
    # QK-clip is not built: the published qk_clip_enabled: True is refused in one line
    with pytest.raises(ConfigError, match=r"^optimizer\.qk_clip_enabled: QK-clip is not built") as err:
        _validate_muon(o)
    assert "\n" not in str(err.value)
    o.qk_clip_enabled = False
    _validate_muon(o)


def test_muon_section_in_a_whole_config():
    section = {k: v for k, v in _published().items()}
    section["qk_clip_enabled"] = False
    overrides = [f"optimizer.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in section.items()]
    cfg = load_config(TINY, overrides)
    assert cfg.optimizer.type == "Muon" and len(ns_schedule(cfg.optimizer)) == 10


def test_flat_coefficients_repeat_ns_steps():
    o = OptimizerConfig(type="Muon", ns_steps=3, ns_coefficients=[1.0, 2, 3.0])
    assert ns_schedule(o) == [(1.0, 2.0, 3.0)] * 3


@pytest.mark.parametrize("field, value, expected", [
    ("type", "Lion", "optimizer.type: must be 'AdamW' or 'Muon'"),
    ("momentum", 1.0, "optimizer.momentum: must be in [0, 1)"),
    ("ns_coefficients", [1.0, 2.0], "optimizer.ns_coefficients: a flat form must be 3 numbers"),
    ("ns_coefficients", [[[1.0, 2.0, 3.0], 0]], "optimizer.ns_coefficients[0]: must be [[a, b, c], n]"),
    ("ns_coefficients", [[[1.0, 2.0], 2]], "optimizer.ns_coefficients[0]: must be [[a, b, c], n]"),
    ("ns_steps", 0, "optimizer.ns_steps: must be a positive integer"),
    ("matched_adamw_rms", 0, "optimizer.matched_adamw_rms: must be > 0"),
    ("adamw_betas", [0.9], "optimizer.adamw_betas: must be two numbers"),
    ("adamw_eps", 0, "optimizer.adamw_eps: must be > 0"),
    ("adamw_include", [""], "optimizer.adamw_include: must be a list of glob strings"),
    ("qk_clip_threshold", 0, "optimizer.qk_clip_threshold: must be > 0"),
    ("qk_clip_enabled", True, "optimizer.qk_clip_enabled: QK-clip is not built"),
])
def test_bad_muon_values_are_one_line(field, value, expected):
    overrides = ["optimizer.type=Muon", f"optimizer.{field}={yaml.safe_dump(value, default_flow_style=True).strip()}"]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
