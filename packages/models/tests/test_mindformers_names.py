"""The model section in MindFormers' names builds the same DeepSeek-V3 as in HF names."""

import os

import mindspore as ms
import numpy as np
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import load_config

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs")


def _build(config_name):
    cfg = load_config(os.path.join(CONFIGS, config_name))
    ms.set_seed(11)
    return mm.build_model(cfg.model, jit=False)


def test_both_naming_styles_build_the_same_model():
    hf = _build("pynative_ds3_tiny.yaml")        # HF DeepSeek-V3 names
    mf = _build("mindformers_ds3_tiny.yaml")     # MindFormers' names
    hf_params = {p.name: p for p in hf.get_parameters()}
    mf_params = {p.name: p for p in mf.get_parameters()}
    assert sorted(hf_params) == sorted(mf_params)
    assert {n: p.shape for n, p in hf_params.items()} == {n: p.shape for n, p in mf_params.items()}
    for name, p in hf_params.items():  # same seed, same structure => same initial weights
        np.testing.assert_array_equal(p.asnumpy(), mf_params[name].asnumpy(), err_msg=name)
    ids = Tensor(np.random.default_rng(0).integers(0, 512, (2, 256)), ms.int32)
    np.testing.assert_array_equal(hf(ids).asnumpy(), mf(ids).asnumpy())
