"""``qk_layernorm: false``: DeepSeek-V3's MLA without its latent norms and Qwen3-MoE's attention
without q_norm / k_norm (what MindFormers builds: IdentityOp norms) match HF transformers' models
with those modules replaced by the identity (fixtures made by tools/make_no_qk_norm_fixtures.py):
logits, loss and gradients; the parameters, the config plan and the count agree; the config
reads back from config.json; an HF export is refused in one line."""

import os
import sys

import numpy as np
import pytest

import mindtrain.models as mm
from mindtrain.config.model_plan import param_specs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import check_logits_loss_grads, check_no_hf_export, load_fixture, TOL  # noqa: E402

NAMES = ["ds3_no_qk_norm", "qwen3_moe_no_qk_norm"]
# as test_hf_parity.py: HF's DeepSeek-V3 has no MTP weights and no sequence-wise aux loss
OVERRIDES = {"ds3_no_qk_norm": dict(num_nextn_predict_layers=0, aux_loss_alpha=0.0), "qwen3_moe_no_qk_norm": {}}


@pytest.mark.parametrize("name", NAMES)
def test_matches_hf_without_the_norms(name, tmp_path):
    model, ref = load_fixture(name, jit=False, **OVERRIDES[name])
    cfg = model.config
    assert cfg.qk_layernorm is False  # read from config.json's mindtrain key
    metrics = check_logits_loss_grads(model, ref, lm_loss_key="lm_loss" if "lm_loss" in ref else "loss")
    if "aux_loss" in ref:
        assert abs(float(metrics["load_balancing_loss"].asnumpy()) - ref["aux_loss"].item()) < TOL

    params = model.trainable_params()
    names = [p.name for p in params]
    assert not [n for n in names if ".self_attn." in n and ("norm" in n.rsplit(".", 2)[-2])], names
    specs = param_specs(cfg)
    assert [(p.name, p.shape) for p in specs] == [(p.name, tuple(p.shape)) for p in params]
    assert mm.count_parameters(cfg)[0] == sum(int(np.prod(p.shape)) for p in params)
    # the same config with the norms: exactly the norm weights more
    with_norms = {p.name for p in param_specs(type(cfg)(**{**cfg.__dict__, "qk_layernorm": True}))}
    extra = sorted(with_norms - set(names))
    assert extra and all(n.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight", "q_norm.weight",
                                     "k_norm.weight")) for n in extra), extra

    check_no_hf_export(model, cfg, tmp_path)


def test_compiled_matches_hf_without_the_norms():
    # compiled layers (their pieces on the weights as graph inputs); eager runs the same pieces
    # for both families above, so one compiled model covers the compile
    name = "ds3_no_qk_norm"
    model, ref = load_fixture(name, jit=True, **OVERRIDES[name])
    check_logits_loss_grads(model, ref, lm_loss_key="lm_loss" if "lm_loss" in ref else "loss")


@pytest.mark.parametrize("name", ["qlora", "qwen3_moe", "deepseek_v4"])
def test_a_checkpoint_with_the_norms_is_refused_without_them(name):
    """An HF checkpoint whose attention has its norms (DeepSeek-V3's latent norms, Qwen3's
    q_norm / k_norm, DeepSeek-V4's q_norm / kv norm) loaded with ``qk_layernorm: false``: one
    line naming the field, not a model that silently drops the checkpoint's norms."""
    from hf_parity_fixtures import fixture_dir

    from mindtrain.config import UserError

    overrides = {"num_nextn_predict_layers": 0} if name == "qlora" else {}
    with pytest.raises(UserError, match=r"model\.qk_layernorm: false") as err:
        mm.from_pretrained(fixture_dir(name), jit=False, qk_layernorm=False, **overrides)
    assert "\n" not in str(err.value) and "norm" in str(err.value).split("(e.g. ")[1]
    mm.from_pretrained(fixture_dir(name), jit=False, **overrides)  # with the norms it loads
