"""What the HF-parity tests share (test_hf_parity.py for DeepSeek-V3, test_qwen3_parity.py for
Qwen3 / Qwen3-MoE): the fixtures the tools/make_*_fixtures.py scripts write, loading one, the
gradient of an HF parameter name, and the logits + loss + gradients check against HF.

Not a test module; the tests import it by path (pytest runs with ``--import-mode=importlib``).
"""

import os

import mindspore as ms
import numpy as np
from mindspore import Tensor
from safetensors.numpy import load_file

import mindtrain.models as mm

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TOL = 1e-4


def fixture_dir(name):
    """fixtures/hf_<name>: transformers' config.json and model.safetensors, and reference.safetensors."""
    return os.path.join(FIXTURES, f"hf_{name}")


def load_fixture(name, jit, **overrides):
    """``(model, reference arrays)`` of fixture ``name``: the model mindtrain builds from the
    fixture's HF checkpoint (``overrides``: config fields, as ``from_pretrained`` takes them)."""
    d = fixture_dir(name)
    model = mm.from_pretrained(d, jit=jit, **overrides)
    return model, load_file(os.path.join(d, "reference.safetensors"))


def grad_of(grads, names, hf_name):
    """The gradient of HF's parameter ``hf_name`` among ``grads`` (aligned with ``names``): an
    HF per-expert name (``...mlp.experts.<e>.gate_proj.weight``) is expert e of the stacked one."""
    if ".mlp.experts." in hf_name:  # HF's per-expert name -> the stacked parameter
        prefix, e, proj, _ = hf_name.rsplit(".", 3)
        return grads[names.index(f"{prefix}.{proj}")][int(e)]
    return grads[names.index(hf_name)]


def check_grads(grads, names, ref):
    """Every ``grad.<HF name>`` of the reference (at least 12, each non-zero) matches."""
    grad_keys = [k for k in ref if k.startswith("grad.")]
    assert len(grad_keys) >= 12
    for key in grad_keys:
        g = grad_of(grads, names, key[5:]).asnumpy()
        np.testing.assert_allclose(g, ref[key], atol=TOL, rtol=0, err_msg=key)
        assert np.abs(ref[key]).max() > 1e-3, key  # the check compares real, non-zero gradients


def check_logits_loss_grads(model, ref, lm_loss_key):
    """The model's logits, loss (``ref["loss"]``), ``lm_loss`` metric (``ref[lm_loss_key]``)
    and gradients match HF's; returns the metrics (for the family's own checks)."""
    ids, labels, mask = (Tensor(ref[k]) for k in ("input_ids", "labels", "loss_mask"))
    np.testing.assert_allclose(model(ids).asnumpy(), ref["logits"], atol=TOL, rtol=0)

    params = model.trainable_params()
    names = [p.name for p in params]

    def fn(ids, labels, mask):
        return model(ids, labels=labels, loss_mask=mask)

    (loss, metrics), grads = ms.value_and_grad(fn, None, params, has_aux=True)(ids, labels, mask)
    assert abs(float(loss.asnumpy()) - ref["loss"].item()) < TOL
    assert abs(float(metrics["lm_loss"].asnumpy()) - ref[lm_loss_key].item()) < TOL
    check_grads(grads, names, ref)
    return metrics


def check_no_hf_export(model, cfg, tmp_path):
    """A model without its q/k norms (``qk_layernorm: false``): its config keeps the key through
    HF's config.json form, and ``save_pretrained`` refuses in one line, writing nothing (HF's
    classes always build the norms)."""
    import pytest
    from mindtrain.config import ConfigError

    hf = mm.config_to_hf(cfg)
    assert hf["qk_layernorm"] is False and mm.config_from_hf(hf) == cfg
    with pytest.raises(ConfigError) as err:
        model.save_pretrained(str(tmp_path / "hf"))
    assert str(err.value).startswith("model.qk_layernorm: false") and "\n" not in str(err.value)
    assert not os.path.exists(tmp_path / "hf")
