"""The max pre-softmax attention logit per layer and head (MindFormers'
``track_max_attention_logit``, what Muon's QK-clip and MaxLogitsMonitor read) equals the one
recomputed from the query and key states of transformers' own DeepseekV3ForCausalLM and
Qwen3ForCausalLM (fixture from tools/make_qkclip_fixtures.py), eager, compiled (the
maximum leaves the compiled piece as an output) and with the attention core in eager row
blocks; off (the default), nothing is recorded."""

import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file

import mindtrain.models as mm
from mindtrain.config.schema import RecomputeConfig
from mindtrain.models import attention
from mindtrain.models.attention import max_attention_logits, track_max_attention_logits

ms.set_device("CPU")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
REF = os.path.join(FIXTURES, "max_logits_hf.npz")


def _run(name, jit, track=True, recompute=False, twice=True):
    d = os.path.join(FIXTURES, f"hf_{name}")
    model = mm.from_pretrained(d, jit=jit)
    if recompute:
        mm.apply_recompute(model, RecomputeConfig(mode="full"))
    if track:
        track_max_attention_logits(model)
    ids = Tensor(load_file(os.path.join(d, "reference.safetensors"))["input_ids"])
    model(ids)
    if twice:
        model(ids)  # a second forward of the step: the running max is unchanged
    return model, max_attention_logits(model)


# every fixture eager; compiled (a compile costs seconds): MLA with a query LoRA and GQA 4/2
@pytest.mark.parametrize("name, jit", [("qlora", False), ("noqlora", False), ("qwen3", False), ("qwen3_tied", False),
                                       ("qlora", True), ("qwen3", True)])
def test_max_logits_match_transformers(name, jit):
    ref = np.load(REF)
    model, got = _run(name, jit)
    layers = sorted(int(k.split("layer")[1]) for k in ref.files if k.startswith(f"{name}.layer"))
    assert sorted(got) == layers
    for i in layers:
        np.testing.assert_allclose(got[i], ref[f"{name}.layer{i}"], rtol=1e-5, atol=1e-5, err_msg=f"layer {i}")
    assert max_attention_logits(model) == {}  # reset: the next step starts afresh


@pytest.mark.parametrize("name", ["qlora", "qwen3"])
def test_eager_row_block_core(name, monkeypatch):
    monkeypatch.setattr(attention.CoreAttention, "row_block_elements", 16 * 8)
    ref = np.load(REF)
    model, got = _run(name, False, recompute=True, twice=False)
    assert all("construct" in layer.self_attn.core_attention.__dict__ for layer in model.model.layers)
    for i in sorted(got):
        np.testing.assert_allclose(got[i], ref[f"{name}.layer{i}"], rtol=1e-5, atol=1e-5)


def test_off_records_nothing():
    _, got = _run("qwen3", False, track=False)
    assert got == {}
