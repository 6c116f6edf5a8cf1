"""parallelism.reshard_after_forward_policy and the FSDP mixed-precision fields, with
MindFormers' meaning; one line naming the field when a value cannot act."""

import copy
import os

import pytest
import yaml

from mindtrain.config import ConfigError, parse_config
from mindtrain.config.fsdp_policy import reshard_after_forward
from mindtrain.config.startup_notes import startup_notes

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = yaml.safe_load(open(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")))
ZERO3 = "optim_grads_params"


def test_policies_as_mindformers_resolves_them():
    assert reshard_after_forward("always", ZERO3, False) == (True, None)
    assert reshard_after_forward("never", ZERO3, False) == (False, None)
    assert reshard_after_forward("default", ZERO3, False) == (True, None)
    # with pipeline parallelism the default keeps a stage's weights gathered
    assert reshard_after_forward("default", ZERO3, True) == (False, None)


def test_policy_that_cannot_act_is_said():
    _, note = reshard_after_forward("always", ZERO3, True)
    assert note.startswith("parallelism.reshard_after_forward_policy=always has no effect with pipeline parallelism")
    _, note = reshard_after_forward("never", "optim_grads", False)
    assert note.startswith("parallelism.reshard_after_forward_policy=never has no effect: weights are resharded "
                           "only under ZeRO-3")


def test_bad_policy_names_the_field():
    raw = copy.deepcopy(TINY)
    with pytest.raises(ConfigError, match="^parallelism.reshard_after_forward_policy: must be one of always, "
                                          "never, default, got 'sometimes'$"):
        parse_config(raw, ["parallelism.reshard_after_forward_policy=sometimes"])


def test_mixed_precision_fields_said_at_start_up():
    cfg = parse_config(copy.deepcopy(TINY), ["parallelism.param_dtype=bfloat16", "parallelism.reduce_dtype=float32"])
    notes = [n for n in startup_notes(cfg, "CPU") if "_dtype" in n and n.startswith("parallelism.")]
    assert notes == ["parallelism.param_dtype=bfloat16 has no effect: FSDP gathers the weights in their stored dtype "
                     "(float32); compute runs in model.compute_dtype, and on CPU only float32 computes"]
    cfg = parse_config(copy.deepcopy(TINY), ["parallelism.reduce_dtype=bfloat16"])
    assert any(n.startswith("parallelism.reduce_dtype=bfloat16 has no effect: gradients are reduced in float32")
               for n in startup_notes(cfg, "CPU"))
