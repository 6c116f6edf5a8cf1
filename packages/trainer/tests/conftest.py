"""Fixtures for in-process Trainer runs on the tiny config with tiny sizes."""

import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The bundled corpus, tokenized once per session (the .bin/.idx prefix)."""
    from mindtrain.trainer.quickstart import prepare_data

    return prepare_data(str(tmp_path_factory.mktemp("data") / "pydoc"))


@pytest.fixture
def tiny_config(tiny_data, tmp_path):
    """``tiny_config(*overrides, config=TINY)``: the tiny config (or the config file ``config``) at seq 32, 2 layers, 3 steps, writing
    under tmp_path; eager layers (``compile.enable=false``: a few steps cost less than a
    compile; test_trainer.py and the msrun tests keep the compiled default)."""
    from mindtrain.config import load_config

    def make(*extra, config=TINY):
        import mindspore as ms

        ms.set_device("CPU")
        ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
        return load_config(config, ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32",
                                  "model.num_hidden_layers=2", "training.global_batch_size=2", "training.steps=3", "compile.enable=false",
                                  f"train_dataset.dataloader.config.data_path=['1', '{tiny_data}']",
                                  f"monitor.metrics_dir={tmp_path}/metrics", *extra])

    return make
