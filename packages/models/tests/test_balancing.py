"""Load balancing: expert-load counts, the aux-loss-free bias update, the sequence-wise loss."""

import mindspore as ms
import numpy as np
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.models.moe import sequence_balance_loss


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                seq_length=16, max_position_embeddings=64, num_nextn_predict_layers=1,
                bias_update_speed=0.01, aux_loss_alpha=0.5)
    base.update(kw)
    return ModelConfig(**base)


def test_expert_load_counts_every_choice_and_resets():
    ms.set_seed(3)
    model = mm.build_model(_cfg(), jit=False)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32))
    model.record_routing(True)
    model(ids, labels=ids)
    model(ids, labels=ids)
    load = model.take_expert_load().asnumpy()
    assert load.shape == (3, 8)  # layers 1, 2 and the MTP module
    np.testing.assert_array_equal(load.sum(1), [2 * 32 * 2] * 3)
    expected = np.stack([np.bincount(np.concatenate([r.asnumpy().ravel() for r in router.recorded]), minlength=8)
                         for router in model.moe_routers()])
    np.testing.assert_array_equal(load, expected)
    np.testing.assert_array_equal(model.take_expert_load().asnumpy(), np.zeros((3, 8)))
    model(ids)  # inference calls do not count
    np.testing.assert_array_equal(model.take_expert_load().asnumpy(), np.zeros((3, 8)))


def test_update_expert_bias_moves_by_sign():
    ms.set_seed(3)
    model = mm.build_model(_cfg(), jit=False)
    load = np.array([[10, 0, 5, 5, 5, 5, 5, 5]] * 3, np.float32)  # mean 5
    model.update_expert_bias(Tensor(load))
    model.update_expert_bias(load)
    for router in model.moe_routers():
        np.testing.assert_allclose(router.e_score_correction_bias.asnumpy(), [-0.02, 0.02, 0, 0, 0, 0, 0, 0],
                                   atol=1e-7)
    assert "e_score_correction_bias" not in " ".join(p.name for p in model.trainable_params())


def test_sequence_balance_loss_matches_numpy():
    rng = np.random.default_rng(4)
    b, s, e, k = 2, 6, 8, 2
    scores = rng.random((b * s, e)).astype(np.float32)
    idx = np.argsort(-scores, -1)[:, :k].astype(np.int32)
    got = sequence_balance_loss(Tensor(scores), Tensor(idx), b, e).asnumpy()
    want = 0.0
    for i in range(b):
        sc, ch = scores[i * s:(i + 1) * s], idx[i * s:(i + 1) * s]
        f = np.bincount(ch.ravel(), minlength=e) * e / (k * s)
        p = (sc / sc.sum(-1, keepdims=True)).mean(0)
        want += (f * p).sum() / b
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_balance_loss_is_weighted_into_the_loss():
    ms.set_seed(3)
    model = mm.build_model(_cfg(), jit=False)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32))
    loss, m = model(ids, labels=ids)
    assert set(m) == {"lm_loss", "mtp_loss", "load_balancing_loss"}
    want = m["lm_loss"].asnumpy() + 0.1 * m["mtp_loss"].asnumpy() + 0.5 * m["load_balancing_loss"].asnumpy()
    np.testing.assert_allclose(loss.asnumpy(), want, rtol=1e-6)
    assert loss.shape == ()
