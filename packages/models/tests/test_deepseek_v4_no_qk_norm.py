"""DeepSeek-V4 with ``qk_layernorm: false`` (issue 34): no query-latent / key-value norms, as
MindFormers builds it (IdentityOp q_layernorm / kv_layernorm), in both attention variants.

- ``dsv4_hybrid``: neither ``q_a_norm`` (the query latent the lightning indexer also reads) nor
  ``kv_norm``; the fixed per-head query norm and the compressors' and indexer's norms stay.
- ``mla``: DeepSeek-V3's MLA without ``q_a_layernorm`` / ``kv_a_layernorm``.

Logits, loss and gradients match HF transformers' DeepseekV4 with those modules replaced by
``torch.nn.Identity`` (the mla variant: V4's model with DeepseekV3Attention composed in, as
tools/make_deepseek_v4_mla_fixtures.py; fixtures by tools/make_deepseek_v4_no_qk_norm_fixtures.py);
the parameters, the config plan and the count agree, with MTP modules too; config.json keeps
the key; an HF export is refused in one line."""

import json
import os
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.config.model_plan import param_specs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import check_logits_loss_grads, check_no_hf_export, fixture_dir, load_fixture  # noqa: E402

HYBRID_NORMS = ("self_attn.q_a_norm.weight", "self_attn.kv_norm.weight")
MLA_NORMS = ("self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight")


def _with_norms(cfg):
    return ModelConfig(**{**cfg.__dict__, "qk_layernorm": True})


def _check_parameters(model, norms):
    """No attention latent norm among the parameters; the plan and the count are the model's;
    the same config with the norms lists exactly those norms more (one pair per layer)."""
    cfg = model.config
    names = [p.name for p in model.trainable_params()]
    assert not [n for n in names if n.endswith(norms)]
    assert [(p.name, p.shape) for p in param_specs(cfg)] == [(p.name, tuple(p.shape)) for p in model.trainable_params()]
    assert mm.count_parameters(cfg)[0] == sum(int(np.prod(p.shape)) for p in model.trainable_params())
    extra = sorted({p.name for p in param_specs(_with_norms(cfg))} - set(names))
    assert extra == sorted(f"model.layers.{i}.{n}" for i in range(len(model.model.layers)) for n in norms)
    return names


def test_hybrid_matches_hf_without_the_norms(tmp_path):
    model, ref = load_fixture("deepseek_v4_no_qk_norm", jit=False)
    cfg = model.config
    assert cfg.qk_layernorm is False and cfg.enable_hyper_connections  # read from config.json's mindtrain key
    assert [layer.kind for layer in model.model.layers] == ["csa", "hca", "sliding"]
    model.record_routing(True)
    check_logits_loss_grads(model, ref, lm_loss_key="lm_loss")
    for i, router in enumerate(model.moe_routers()):  # the routers choose as HF's (the learned ones after
        np.testing.assert_array_equal(np.sort(router.recorded[0].asnumpy(), -1), ref[f"topk.{i}"])  # attention)
    names = _check_parameters(model, HYBRID_NORMS)
    # the compressors' and the indexer's norms stay (MindFormers' Compressor always builds its norm)
    assert {"model.layers.0.self_attn.compressor.kv_norm.weight",
            "model.layers.0.self_attn.compressor.indexer.kv_norm.weight",
            "model.layers.1.self_attn.compressor.kv_norm.weight"} <= set(names)

    check_no_hf_export(model, cfg, tmp_path)


def test_mla_variant_matches_hf_without_the_norms():
    name = "deepseek_v4_mla_no_qk_norm"
    with open(os.path.join(fixture_dir(name), "overrides.json"), encoding="utf-8") as f:
        overrides = json.load(f)
    model, ref = load_fixture(name, jit=False, **overrides)
    assert model.config.qk_layernorm is False and model.config.experimental_attention_variant == "mla"
    check_logits_loss_grads(model, ref, lm_loss_key="lm_loss")
    _check_parameters(model, MLA_NORMS)


def _tiny(variant: str, **kw) -> ModelConfig:
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=16) if variant == "mla" else {}
    return ModelConfig(**dict(
        model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", seq_length=16, vocab_size=64, hidden_size=32,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, compress_ratios=[4, 0, 0],
        o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=2, hc_mult=2, num_hash_layers=1,
        max_position_embeddings=64, scoring_func="sqrtsoftplus", num_nextn_predict_layers=1, qk_layernorm=False,
        experimental_attention_variant=variant, initializer_range=0.1, **mla, **kw))


@pytest.mark.parametrize("variant", ["dsv4_hybrid", "mla"])
def test_mtp_modules_and_plain_residuals_without_the_norms(variant):
    """With an MTP module (its attention without the norms too) and with plain residual layers
    (enable_hyper_connections: false) the model builds what the plan lists; a step's loss is
    finite and the MTP module's attention trains."""
    norms = MLA_NORMS if variant == "mla" else HYBRID_NORMS
    for hc in (True, False):
        cfg = _tiny(variant, enable_hyper_connections=hc, enable_hc_head=False)
        ms.set_seed(3)
        model = mm.build_model(cfg, jit=False)
        assert len(model.model.layers) == 3
        _check_parameters(model, norms)
    # the last one (plain residuals): a training step
    params = model.trainable_params()
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, 64, (2, 16)), ms.int32)
    labels = Tensor(rng.integers(0, 64, (2, 16)), ms.int32)
    (loss, metrics), grads = ms.value_and_grad(lambda i, l: model(i, labels=l), None, params, has_aux=True)(ids, labels)
    assert np.isfinite(float(loss.asnumpy())) and "mtp_loss" in metrics
    proj = "q_a_proj" if variant == "mla" else "kv_proj"
    mtp = [g for p, g in zip(params, grads) if p.name == f"model.layers.2.self_attn.{proj}.weight"]
    assert mtp and float(np.abs(mtp[0].asnumpy()).max()) > 0
