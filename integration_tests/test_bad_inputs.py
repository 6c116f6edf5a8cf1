"""Bad inputs to run_mindformer.py end with one line on stderr and exit status 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
MF_TINY = os.path.join(ROOT, "configs", "mindformers_ds3_tiny.yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = tmp_path_factory.mktemp("bad")
    good = prepare_data(str(tmp / "pydoc"))
    # a .bin cut short: it no longer matches its .idx
    shutil.copy(good + ".idx", str(tmp / "cut_text_document.idx"))
    with open(good + ".bin", "rb") as src, open(tmp / "cut_text_document.bin", "wb") as dst:
        dst.write(src.read(1000))
    return tmp, good


def _run(tmp, *overrides, config=TINY):
    args = [sys.executable, ENTRY, "--config", config, "--mode", "1", "--override", "training.steps=1",
            "--override", f"monitor.metrics_dir={tmp / 'metrics'}"]
    for o in overrides:
        args += ["--override", o]
    return subprocess.run(args, cwd=str(tmp), capture_output=True, text=True, timeout=300)


def _one_line(r) -> str:
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("[WARNING]")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("case, needle", [
    ("missing_prefix", "neither .bin nor .idx exists at this prefix"),
    ("bin_mismatch", "the .bin is truncated or belongs to another .idx"),
])
def test_data_file_errors(data, case, needle):
    tmp, good = data
    prefix = {"missing_prefix": str(tmp / "nothing_text_document"),
              "bin_mismatch": str(tmp / "cut_text_document")}[case]
    line = _one_line(_run(tmp, f"train_dataset.dataloader.config.data_path=['1', '{prefix}']"))
    assert needle in line and prefix in line


@pytest.mark.parametrize("overrides, needle", [
    (["train_dataset.dataloader.config.seq_length=128"], "seq_length: 128 must equal model.seq_length (256)"),
    (["training.local_batch_size=2", "training.global_batch_size=3"],
     "training.global_batch_size: 3 must be a positive multiple"),
    (["parallelism.tensor_parallel=3"], "parallelism.tensor_parallel"),
    (["train_dataset.dataloader.config.split=null"], "split: required when data_path is set"),
    (["train_dataset.dataloader.sizes=null"], "sizes: is required"),
    (["lr_scheduler.type=Cosine"], "unknown schedule 'Cosine'"),
])
def test_config_errors(data, overrides, needle):
    tmp, good = data
    line = _one_line(_run(tmp, f"train_dataset.dataloader.config.data_path=['1', '{good}']", *overrides))
    assert needle in line


def test_token_ids_beyond_vocab(data):
    tmp, good = data
    line = _one_line(_run(tmp, f"train_dataset.dataloader.config.data_path=['1', '{good}']", "model.vocab_size=64"))
    assert f"{good}.bin: largest token id " in line and "does not fit model.vocab_size 64" in line


def test_missing_config_file(data):
    tmp, _ = data
    line = _one_line(_run(tmp, config=str(tmp / "missing.yaml")))
    assert "missing.yaml' does not exist" in line


def test_legacy_config_is_rejected(data, tmp_path):
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("context:\n  mode: 0\nmodel:\n  model_config:\n    hidden_size: 128\n")
    line = _one_line(_run(data[0], config=str(legacy)))
    assert "legacy" in line.lower() or "model_config" in line


@pytest.mark.parametrize("device", ["Ascend", "GPU"])
def test_swap_on_a_device_is_refused(data, tmp_path, device):
    """#16: the MindFormers config with activation swap on, for Ascend (or GPU): swap is not
    built, so the job is refused in one line that says to use recompute (on CPU: a note)."""
    raw = yaml.safe_load(open(MF_TINY))
    raw["context"]["device_target"] = device
    raw["swap"] = {"enable": True, "default_prefetch": 1,
                   "layer_swap": [{"layers": [0, 1], "backward_prefetch": 1}], "op_swap": None}
    config = tmp_path / "swap.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    line = _one_line(_run(data[0], config=str(config)))
    assert line == (f"run_mindformer.py: error: swap.enable: activation offload to host is not built for {device}; "
                    "set it to false and use recompute (recompute.mode: full or select) to save activation memory"), line
