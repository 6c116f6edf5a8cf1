"""`pip install packages/config` (and config + data) into a clean venv, without MindSpore."""

import os
import subprocess
import sys
import venv

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _venv(path):
    venv.EnvBuilder(with_pip=True).create(path)
    return os.path.join(path, "bin", "python")


def _pip(python, *args):
    proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_config_alone(tmp_path):
    py = _venv(str(tmp_path / "v"))
    _pip(py, os.path.join(ROOT, "packages", "config"))
    code = ("import sys, mindtrain.config as c; cfg = c.load_config(sys.argv[1], world_size=2); "
            "assert 'numpy' not in sys.modules and 'mindspore' not in sys.modules; "
            "print(cfg.model.hidden_size)")
    out = subprocess.run([py, "-c", code, os.path.join(ROOT, "configs", "pynative_ds3.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "7168"
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    assert "numpy" not in listed and "mindspore" not in listed


_READ = r"""
import os, sys, numpy as np
from mindtrain.data import IndexedDatasetBuilder, IndexedDataset, build_dataset
d = sys.argv[1]
prefix = os.path.join(d, "tiny_text_document")
b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
rng = np.random.RandomState(0)
for n in rng.randint(5, 40, size=50):
    b.add_document(list(rng.randint(3, 250, size=n)) + [1], [n + 1])
b.finalize(prefix + ".idx")
ds = IndexedDataset(prefix)
assert len(ds) == 50 and ds[0][-1] == 1
section = {"dataloader": {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
           "sizes": [20, 0, 0], "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
           "config": {"seq_length": 16, "split": "1, 0, 0", "data_path": ["1", prefix],
                      "path_to_cache": os.path.join(d, "cache")}}}
gpt = build_dataset(section)
sample = gpt[0]
assert sample["input_ids"].shape == (16,) and (sample["labels"][:-1] == sample["input_ids"][1:]).all()
assert "mindspore" not in sys.modules
print(len(gpt), np.__version__)
"""


def test_config_and_data_without_mindspore(tmp_path):
    py = _venv(str(tmp_path / "v"))
    _pip(py, os.path.join(ROOT, "packages", "config"), os.path.join(ROOT, "packages", "data"))
    out = subprocess.run([py, "-c", _READ, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    n, numpy_version = out.stdout.split()
    assert int(n) >= 20
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    assert "mindspore" not in listed
