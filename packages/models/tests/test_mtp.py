"""Multi-token prediction: the loss checked against a numpy re-derivation of the MTP wiring
(shifted tokens, enorm/hnorm/eh_proj order, shared head after shared_head.norm, mask shift).
The MTP module's decoder block itself is the HF-checked DecoderLayer."""

import mindspore as ms
import numpy as np
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ModelConfig

from mindtrain.models.attention_mask import additive_mask


def tiny(**kw):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
                max_position_embeddings=64, initializer_range=0.1, num_nextn_predict_layers=2,
                mtp_loss_scaling_factor=0.3, aux_loss_alpha=0.01, compute_dtype="float32")
    base.update(kw)
    return ModelConfig(**base)


def _rms(x, w, eps=1e-6):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _ce(logits, labels, mask):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return (ce * mask).sum() / mask.sum()


def test_mtp_loss_matches_numpy_rederivation():
    ms.set_seed(5)
    cfg = tiny()
    model = mm.build_model(cfg, jit=False)
    rng = np.random.default_rng(0)
    b, s = 2, 16
    ids = rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    mask = (rng.random((b, s)) > 0.25).astype(np.float32)
    loss, metrics = model(Tensor(ids), labels=Tensor(labels), loss_mask=Tensor(mask))

    # main trunk, run layer by layer
    pos = Tensor(np.tile(np.arange(s, dtype=np.int32), (b, 1)))
    cos, sin = model.model.rotary_emb(pos)
    cos, sin = cos.expand_dims(1), sin.expand_dims(1)
    mask_add = additive_mask(None, b, s, cfg.num_attention_heads)
    emb_w = model.model.embed_tokens.weight.asnumpy()
    head_w = model.lm_head.weight.asnumpy()
    h = Tensor(emb_w[ids])
    for layer in list(model.model.layers)[:cfg.num_hidden_layers]:
        h = layer(h, cos, sin, mask_add)[0]
    lm = _ce(_rms(h.asnumpy(), model.model.norm.weight.asnumpy()) @ head_w.T, labels, mask)
    np.testing.assert_allclose(metrics["lm_loss"].asnumpy(), lm, rtol=1e-5)

    losses = []
    for k in (1, 2):
        mtp = model.model.layers[cfg.num_hidden_layers + k - 1]
        ids_k = np.concatenate([ids[:, k:], np.zeros((b, k), np.int32)], 1)
        labels_k = np.concatenate([labels[:, k:], np.zeros((b, k), np.int32)], 1)
        mask_k = np.concatenate([mask[:, k:], np.zeros((b, k), np.float32)], 1)
        e = _rms(emb_w[ids_k], mtp.enorm.weight.asnumpy())
        hh = _rms(h.asnumpy(), mtp.hnorm.weight.asnumpy())
        x = np.concatenate([e, hh], -1) @ mtp.eh_proj.weight.asnumpy().T
        h = mm.DecoderLayer.construct(mtp, Tensor(x.astype(np.float32)), cos, sin, mask_add)[0]
        logits = _rms(h.asnumpy(), mtp.shared_head.norm.weight.asnumpy()) @ head_w.T
        losses.append(_ce(logits, labels_k, mask_k))
    np.testing.assert_allclose(metrics["mtp_loss"].asnumpy(), np.mean(losses), rtol=1e-5)
    total = lm + 0.3 * np.mean(losses) + 0.01 * metrics["load_balancing_loss"].asnumpy()
    np.testing.assert_allclose(loss.asnumpy(), total, rtol=1e-5)


def test_mtp_weights_get_gradients_and_hf_names():
    ms.set_seed(6)
    cfg = tiny(num_nextn_predict_layers=1)
    model = mm.build_model(cfg, jit=False)
    names = [p.name for p in model.trainable_params()]
    for n in ("model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
              "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.kv_b_proj.weight",
              "model.layers.2.mlp.gate.weight"):
        assert n in names
    ids = Tensor(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 16)).astype(np.int32))

    def fn(ids):
        return model(ids, labels=ids)

    _, grads = ms.value_and_grad(fn, None, model.trainable_params(), has_aux=True)(ids)
    g = dict(zip(names, grads))
    assert np.abs(g["model.layers.2.eh_proj.weight"].asnumpy()).max() > 0
    assert np.abs(g["model.layers.2.shared_head.norm.weight"].asnumpy()).max() > 0
    hf = mm.hf_state_dict(model)  # the official checkpoint also stores the shared copies
    np.testing.assert_array_equal(hf["model.layers.2.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(hf["model.layers.2.shared_head.head.weight"], hf["lm_head.weight"])
