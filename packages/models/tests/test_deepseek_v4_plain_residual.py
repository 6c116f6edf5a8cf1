"""DeepSeek-V4 with ``enable_hyper_connections: false``: plain residual layers (MindFormers'
TransformerLayer) instead of the hc_mult streams. Logits, loss and gradients match HF
transformers' DeepseekV4 with its layers rewired to plain residuals around HF's own attention
and MoE (fixture made by tools/make_deepseek_v4_plain_residual_fixture.py); parameters, the
config plan and the count agree, with MTP modules and in the mla variant too; an HF export is
refused in one line."""

import os
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ConfigError, ModelConfig
from mindtrain.config.model_plan import param_specs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import check_logits_loss_grads, load_fixture  # noqa: E402


def test_matches_hf_with_plain_residuals(tmp_path):
    model, ref = load_fixture("deepseek_v4_plain", jit=False)
    cfg = model.config
    assert not cfg.enable_hyper_connections and not cfg.enable_hc_head  # config.json's mindtrain keys
    check_logits_loss_grads(model, ref, lm_loss_key="lm_loss")
    params = model.trainable_params()
    assert not [p.name for p in params if "_hc." in p.name or "hc_head" in p.name]
    assert [(p.name, p.shape) for p in param_specs(cfg)] == [(p.name, tuple(p.shape)) for p in params]
    assert mm.count_parameters(cfg)[0] == sum(int(np.prod(p.shape)) for p in params)
    assert mm.parallel_plan(model).activation == (cfg.hidden_size,)  # one residual between units
    assert mm.config_from_hf(mm.config_to_hf(cfg)) == cfg
    with pytest.raises(ConfigError) as err:
        model.save_pretrained(str(tmp_path / "hf"))
    assert str(err.value).startswith("model.enable_hyper_connections: false") and "\n" not in str(err.value)


def _plain(**kw):
    base = dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", seq_length=16, vocab_size=64,
                hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4,
                num_experts_per_tok=2, compress_ratios=[4, 0, 0], o_groups=2, o_lora_rank=8, index_n_heads=2,
                index_head_dim=16, index_topk=2, hc_mult=2, num_hash_layers=1, max_position_embeddings=64,
                scoring_func="sqrtsoftplus", num_nextn_predict_layers=1, enable_hyper_connections=False,
                enable_hc_head=False, initializer_range=0.1)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("variant", ["dsv4_hybrid", "mla"])
def test_mtp_and_mla_variant_build_what_the_plan_lists(variant):
    extra = dict(kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=16) if variant == "mla" else {}
    cfg = _plain(experimental_attention_variant=variant, **extra)
    ms.set_seed(3)
    model = mm.build_model(cfg, jit=False)
    params = model.trainable_params()
    assert [(p.name, p.shape) for p in param_specs(cfg)] == [(p.name, tuple(p.shape)) for p in params]
    with_hc = {p.name for p in param_specs(_plain(experimental_attention_variant=variant,
                                                  enable_hyper_connections=True, **extra))}
    assert sorted(with_hc - {p.name for p in params}) == sorted(
        f"model.layers.{i}.{hc}.{w}" for i in range(3) for hc in ("attn_hc", "ffn_hc") for w in ("fn", "base", "scale"))
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, 64, (2, 16)), ms.int32)
    labels = Tensor(rng.integers(0, 64, (2, 16)), ms.int32)
    h = model.embed(ids)
    assert tuple(h.shape) == (2, 16, 32)  # the embeddings, no streams
    # the main trunk by hand: each layer adds its attention and its MoE output to the residual
    layer = model.model.layers[0]
    tables = model.tables(16)
    layer.self_attn.table_keys = tuple(tables)
    out, _, _ = layer(h, ids, *tables.values())
    x = h + (layer.attention(layer.input_layernorm(h), tables) if variant == "mla"
             else layer.self_attn(layer.input_layernorm(h), *tables.values()))
    y, _, _ = layer.mlp(layer.post_attention_layernorm(x), ids)
    np.testing.assert_allclose(out.asnumpy(), (x + y).asnumpy(), rtol=0, atol=1e-6)
    (loss, metrics), grads = ms.value_and_grad(lambda i, l: model(i, labels=l), None, params, has_aux=True)(ids, labels)
    assert np.isfinite(float(loss.asnumpy())) and "mtp_loss" in " ".join(metrics)
    mtp = [g for p, g in zip(params, grads) if p.name.startswith("model.layers.2.") and "eh_proj" in p.name]
    assert mtp and float(np.abs(mtp[0].asnumpy()).max()) > 0  # the MTP module trains
