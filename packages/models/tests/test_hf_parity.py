"""Parity with HF transformers' DeepseekV3 (fixtures made by tools/make_hf_fixtures.py)."""

import os
import sys

import numpy as np
import pytest
from mindspore import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import check_logits_loss_grads, load_fixture  # noqa: E402  (shared with Qwen3's)


def _load(name, jit):
    # HF's config.json says num_nextn_predict_layers=1 but HF has no MTP weights: turn it off,
    # and aux_loss_alpha=0 so the loss is the plain lm loss the fixture holds
    return load_fixture(name, jit, num_nextn_predict_layers=0, aux_loss_alpha=0.0)


@pytest.mark.parametrize("name", ["qlora", "noqlora"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_logits_loss_grads_match_hf(name, jit):
    model, ref = _load(name, jit)
    check_logits_loss_grads(model, ref, lm_loss_key="loss")  # the fixture's loss is the lm loss


@pytest.mark.parametrize("name", ["qlora", "noqlora"])
def test_router_choices_match_hf(name):
    model, ref = _load(name, False)
    model.record_routing(True)
    model(Tensor(ref["input_ids"]))
    routers = model.moe_routers()
    layers = sorted(int(k.split(".")[1]) for k in ref if k.startswith("topk."))
    assert layers == model.moe_layer_ids
    for layer, router in zip(layers, routers):
        (idx,) = router.recorded
        np.testing.assert_array_equal(np.sort(idx.asnumpy(), -1), ref[f"topk.{layer}"])
        # the correction bias is non-zero and decides some choices: unbiased top-k differs
        assert np.abs(router.e_score_correction_bias.asnumpy()).max() > 0
    # the bias decides choices: without it some tokens pick other experts
    for router in routers:
        router.recorded = []
        router.e_score_correction_bias.set_data(Tensor(np.zeros(router.n_experts, np.float32)))
    model(Tensor(ref["input_ids"]))
    changed = [not np.array_equal(np.sort(r.recorded[0].asnumpy(), -1), ref[f"topk.{layer}"])
               for layer, r in zip(layers, routers)]
    assert all(changed)
