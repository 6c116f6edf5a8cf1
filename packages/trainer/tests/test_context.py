"""training.deterministic and context.max_device_memory at start-up."""

import os
import subprocess
import sys

import pytest

from mindtrain.config import ConfigError
from mindtrain.trainer.runtime import apply_context

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# MindSpore's deterministic switch can be set once per process: probe it in a child
DETERMINISTIC = """
import mindspore as ms
from mindtrain.config import load_config
from mindtrain.trainer.runtime import apply_context
ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
before = ms.get_context("deterministic")
cfg = load_config("configs/pynative_ds3_tiny.yaml", ["training.deterministic=true"])
apply_context(cfg, "CPU")
apply_context(cfg, "CPU")  # a second Trainer in the same process
print("deterministic", before, ms.get_context("deterministic"))
"""


def test_deterministic_switch_is_set():
    r = subprocess.run([sys.executable, "-c", DETERMINISTIC], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "deterministic OFF ON" in r.stdout.splitlines(), r.stdout[-2000:]


def test_max_device_memory_note_on_cpu(tiny_config):
    notes = apply_context(tiny_config("context.max_device_memory=8GB"), "CPU")
    assert notes == ["context.max_device_memory=8GB has no effect on CPU (applied on Ascend only)"]
    with pytest.raises(ConfigError, match=r"^context.max_device_memory: is '8 gigabytes'; give a size like"):
        apply_context(tiny_config("context.max_device_memory='8 gigabytes'"), "CPU")
