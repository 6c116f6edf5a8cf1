"""DeepSeek-V4's ``mla`` attention variant (MindFormers' ``experimental_attention_variant:
"mla"``) against transformers' own modules composed as MindFormers composes them (V4's layer
with DeepseekV3Attention; fixture by tools/make_deepseek_v4_mla_fixtures.py), and V4's MTP
(MindFormers' definition; HF's V4 builds none): its structure, its gradient by finite
differences, and ``num_nextn_predict_layers: 0`` being exactly the base model."""

import json
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.models.attention import MLAttention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import check_logits_loss_grads, fixture_dir, load_fixture  # noqa: E402

NAME = "deepseek_v4_mla"


def _overrides(**more):
    with open(os.path.join(fixture_dir(NAME), "overrides.json"), encoding="utf-8") as f:
        return dict(json.load(f), **more)


def _load(jit=False, **more):
    return load_fixture(NAME, jit, **_overrides(**more))


def test_mla_variant_matches_hf_modules_composed():
    """Logits, loss and every gradient above 1e-3 at the DeepSeek-V3 tolerance (1e-4); the
    V3 attention cell is the package's MLAttention; the routers choose as HF's. (Eager: the
    compiled build passes too, at 30 s of compiling.)"""
    jit = False
    model, ref = _load(jit)
    assert all(isinstance(layer.self_attn, MLAttention) for layer in model.model.layers)
    assert model.config.hc_sinkhorn_iters == 0 and not model.config.enable_hc_head
    model.record_routing(True)
    metrics = check_logits_loss_grads(model, {k: v for k, v in ref.items() if not k.startswith("grad.")
                                              or np.abs(v).max() > 1e-3}, lm_loss_key="lm_loss")
    assert "load_balancing_loss" not in metrics and "mtp_loss" not in metrics
    if not jit:
        for i, router in enumerate(model.moe_routers()):
            got = np.sort(router.recorded[0].asnumpy(), -1)
            np.testing.assert_array_equal(got, ref[f"topk.{i}"], err_msg=f"layer {i}")


def _batch(ref):
    return tuple(Tensor(ref[k]) for k in ("input_ids", "labels", "loss_mask"))


def test_mtp_zero_is_the_base_model_and_one_adds_its_scaled_loss():
    """MTP on (one module, MindFormers' V4: after the streams' collapse and the final norm)
    leaves the logits and the main loss exactly those of the model without it; the loss
    adds mtp_loss_scaling_factor x the module's loss (and the balance loss, when asked)."""
    base, ref = _load()
    ids, labels, mask = _batch(ref)
    loss0, m0 = base(ids, labels=labels, loss_mask=mask)
    ms.set_seed(1)
    mtp, _ = _load(num_nextn_predict_layers=1, mtp_loss_scaling_factor=0.3)
    assert len(mtp.model.layers) == 4 and mtp.num_mtp == 1
    np.testing.assert_array_equal(mtp(ids).asnumpy(), base(ids).asnumpy())
    loss1, m1 = mtp(ids, labels=labels, loss_mask=mask)
    assert float(m1["lm_loss"].asnumpy()) == float(m0["lm_loss"].asnumpy()) == float(loss0.asnumpy())
    want = float(m0["lm_loss"].asnumpy()) + 0.3 * float(m1["mtp_loss"].asnumpy())
    assert abs(float(loss1.asnumpy()) - want) < 1e-5
    assert float(m1["mtp_loss"].asnumpy()) > 1.0


def test_mtp_structure_follows_mindformers():
    """The MTP module of MindFormers' MultiTokenPredictionLayer: enorm, hnorm, eh_proj
    [H, 2H], a V4 layer of the variant with a learned (never hashed) router, its final norm
    (shared_head.norm, MindFormers' final_layernorm) and hc_head only with enable_hc_head."""
    for head in (False, True):
        from mindtrain.models.hf_checkpoint import read_hf_config

        cfg = read_hf_config(fixture_dir(NAME), **_overrides(num_nextn_predict_layers=1, num_hash_layers=3,
                                                              enable_hc_head=head))
        model = mm.build_model(cfg, jit=False)
        layer = model.model.layers[3]
        names = {p.name for p in model.trainable_params() if p.name.startswith("model.layers.3.")}
        h = model.config.hidden_size
        assert tuple(layer.eh_proj.weight.shape) == (h, 2 * h)
        assert {"model.layers.3.enorm.weight", "model.layers.3.hnorm.weight", "model.layers.3.eh_proj.weight",
                "model.layers.3.shared_head.norm.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                "model.layers.3.attn_hc.fn", "model.layers.3.ffn_hc.fn"} <= names
        assert any(n.startswith("model.layers.3.hc_head.") for n in names) == head
        assert not layer.mlp.hashed and all(model.model.layers[i].mlp.hashed for i in range(3))
        assert model.moe_layer_ids == [0, 1, 2, 3]


def test_mtp_gradient_by_finite_differences():
    """d(loss)/d(w) of MTP weights (eh_proj, its attention, its hyper-connection) at each
    one's largest-gradient entry against central differences of the loss
    (float32: step 1e-2, 2% + 2e-4), on one row of 8 tokens."""
    model, ref = _load(num_nextn_predict_layers=1, mtp_loss_scaling_factor=0.5)
    ids, labels, mask = (t[:1, :8] for t in _batch(ref))
    params = model.trainable_params()
    names = [p.name for p in params]

    def loss_fn(i, l, m):
        return model(i, labels=l, loss_mask=m)[0]

    grads = ms.grad(loss_fn, None, params)(ids, labels, mask)
    for name in ("model.layers.3.eh_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                 "model.layers.3.attn_hc.fn"):
        p = params[names.index(name)]
        g = grads[names.index(name)].asnumpy().reshape(-1)
        base = p.asnumpy().copy()
        j = int(np.argmax(np.abs(g)))
        diffs = []
        for sign in (1.0, -1.0):
            w = base.copy().reshape(-1)
            w[j] += sign * 1e-2
            p.set_data(Tensor(w.reshape(base.shape)))
            diffs.append(float(loss_fn(ids, labels, mask).asnumpy()))
        p.set_data(Tensor(base))
        fd = (diffs[0] - diffs[1]) / 2e-2
        assert abs(g[j]) > 1e-3 and abs(fd - g[j]) <= 2e-2 * abs(fd) + 2e-4, (name, j, fd, g[j])


def test_hybrid_variant_takes_an_mtp_module_too():
    """The MTP module of the hybrid (HF) variant: a sliding-window V4 layer (MindFormers lists
    compress ratio 0 for it), trained with the main model."""
    from mindtrain.config import ModelConfig, validate_model

    cfg = ModelConfig(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", vocab_size=64, hidden_size=32,
                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                      compress_ratios=[0, 4, 0], o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16,
                      index_topk=2, hc_mult=2, num_hash_layers=1, max_position_embeddings=64, seq_length=16,
                      num_nextn_predict_layers=1, aux_loss_alpha=0.0)
    validate_model(cfg)
    model = mm.build_model(cfg, jit=False, seed=3)
    assert model.model.layers[2].kind == "sliding" and model.model.layers[2].self_attn.compressor is None
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (1, 16)).astype(np.int32))
    params = model.trainable_params()
    (loss, metrics), grads = ms.value_and_grad(lambda i: model(i, labels=i), None, params, has_aux=True)(ids)
    assert np.isfinite(float(loss.asnumpy())) and "mtp_loss" in metrics
    names = [p.name for p in params]
    assert np.abs(grads[names.index("model.layers.2.eh_proj.weight")].asnumpy()).max() > 0
