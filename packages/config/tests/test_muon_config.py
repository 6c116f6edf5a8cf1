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
QWEN3 = os.path.join(ROOT, "configs", "pynative_qwen3_tiny.yaml")


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
    # the published qk_clip_enabled: True is valid with Muon
    assert o.qk_clip_enabled is True
    _validate_muon(o)


def test_muon_section_in_a_whole_config():
    section = {k: v for k, v in _published().items()}  # QK-clip on, as published
    overrides = [f"optimizer.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in section.items()]
    cfg = load_config(TINY, overrides)
    assert cfg.optimizer.type == "Muon" and len(ns_schedule(cfg.optimizer)) == 10
    assert cfg.optimizer.qk_clip_enabled is True and cfg.optimizer.qk_clip_threshold == 100.0


@pytest.mark.parametrize("overrides, expected", [
    # MindFormers' AdamW ignores it: refused
    (["optimizer.qk_clip_enabled=true"], "optimizer.qk_clip_enabled: QK-clip is part of Muon"),
    # MindFormers clips MLA only (apply_qk_clip_scaling returns without multi_latent_attention)
    (["optimizer.type=Muon", "optimizer.qk_clip_enabled=true", "config=qwen3"],
     "optimizer.qk_clip_enabled: MindFormers' QK-clip scales MLA"),
])
def test_qk_clip_refusals_are_one_line(overrides, expected):
    path = QWEN3 if "config=qwen3" in overrides else TINY
    with pytest.raises(ConfigError) as err:
        load_config(path, [o for o in overrides if o != "config=qwen3"])
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


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
])
def test_bad_muon_values_are_one_line(field, value, expected):
    overrides = ["optimizer.type=Muon", f"optimizer.{field}={yaml.safe_dump(value, default_flow_style=True).strip()}"]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["ulysses", "hybrid"])
def test_qk_clip_and_max_logits_monitor_are_built_with_ulysses(method):
    """Ulysses / hybrid context parallelism report the max attention logits (issue 34): each
    rank's head groups' maxima are all-gathered over the Ulysses group (integration_tests/
    test_cp_pp_parity.py compares them with one process's)."""
    cp = ["parallelism.context_parallel=4", f"parallelism.context_parallel_method={method}"] + \
        (["parallelism.ulysses_degree_in_cp=2"] if method == "hybrid" else [])
    cfg = load_config(TINY, ["optimizer.type=Muon", "optimizer.qk_clip_enabled=true"] + cp, world_size=4)
    assert cfg.optimizer.qk_clip_enabled and cfg.parallelism.context_parallel_method == method
    cfg = load_config(TINY, ["callbacks=[{type: MaxLogitsMonitor}]"] + cp, world_size=4)
    assert [c.type for c in cfg.callbacks] == ["MaxLogitsMonitor"]
