"""Dropout (issue 34): the counter-based masks (drop fraction, scaling, determinism, the same
mask for every split of the tokens, heads and sequence) and the models with it on (a training
step's forward differs from evaluation, which has none; compiled layers and activation
recompute draw the same masks as the eager forward). The layouts themselves are proven
against one process in integration_tests/test_trainer_layouts.py, whose DeepSeek-V3 runs all
train with dropout."""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, ops

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.config.schema import RecomputeConfig
from mindtrain.models.dropout import Dropout, keep_scale, token_keys

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
           n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
           q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
           max_position_embeddings=64, num_nextn_predict_layers=1, aux_loss_alpha=0.01,
           attention_dropout=0.2, hidden_dropout=0.3)
QWEN3 = dict(model_type="qwen3", architectures="Qwen3ForCausalLM", vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             seq_length=16, max_position_embeddings=64, attention_dropout=0.2, hidden_dropout=0.3)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_drop_fraction_and_scale(p):
    m = keep_scale(p, 3, 1, np.arange(200_000, dtype=np.uint64))
    assert abs(float((m == 0).mean()) - p) < 0.005
    kept = m[m != 0]
    assert np.all(kept == np.float32(1.0 / (1.0 - p)))
    assert abs(float(m.mean()) - 1.0) < 0.01  # the expectation is kept


def test_deterministic_per_seed_and_different_across_seeds_and_steps():
    ids = np.arange(50_000, dtype=np.uint64)
    a = keep_scale(0.3, 7, 1, ids)
    assert np.array_equal(a, keep_scale(0.3, 7, 1, ids))
    for other in (keep_scale(0.3, 8, 1, ids), keep_scale(0.3, 7, 2, ids)):  # another seed, another step
        differ = float(((a == 0) != (other == 0)).mean())
        assert abs(differ - 2 * 0.3 * 0.7) < 0.01  # independent draws


def test_token_identity_is_its_sample_and_position():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 100, (3, 8))
    ids[2] = ids[0]
    k = token_keys(ids)
    assert np.array_equal(k[0], k[2])  # a sample's identity is its content, wherever it sits
    assert len(set(k[:2].ravel().tolist())) == 16
    assert np.array_equal(token_keys(ids[1:2]), k[1:2])  # another rank holding only that sample


def _state(tokens, step=3):
    d = Dropout(attention=0.25, hidden=0.4)
    d.begin_step(step, 11)
    d.set_tokens(tokens)
    return d


def test_masks_are_the_same_for_every_split():
    tokens = token_keys(np.random.RandomState(1).randint(0, 100, (2, 8)))
    whole = _state(tokens)
    h = whole.hidden_mask(0, 1, (2, 8, 6)).asnumpy()
    # sequence parallelism: rank i's rows are shard i of the hidden states
    shards = []
    for i in range(2):
        part = _state(tokens)
        part.sequence_shard = (i, 2)
        shards.append(part.hidden_mask(0, 1, (2, 4, 6)).asnumpy())
    assert np.array_equal(np.concatenate(shards, 1), h)
    # data parallelism: a rank holding sample 1 only
    assert np.array_equal(_state(tokens[1:]).hidden_mask(0, 1, (1, 8, 6)).asnumpy(), h[1:])
    a = whole.attention_mask(1, 4, 0, 8).asnumpy()
    # tensor parallelism: heads 2, 3 on the second rank
    assert np.array_equal(_state(tokens).attention_mask(1, 2, 2, 8).asnumpy(), a[:, 2:])
    # context parallelism: a chunk of the queries (their tokens) over all the keys
    idx = np.array([1, 2, 5, 6])
    assert np.array_equal(_state(tokens[:, idx]).attention_mask(1, 4, 0, 8).asnumpy(), a[:, :, idx])
    # layers, sites and steps draw apart
    assert not np.array_equal(whole.hidden_mask(1, 1, (2, 8, 6)).asnumpy(), h)
    assert not np.array_equal(whole.hidden_mask(0, 2, (2, 8, 6)).asnumpy(), h)
    assert not np.array_equal(_state(tokens, step=4).hidden_mask(0, 1, (2, 8, 6)).asnumpy(), h)


def test_attention_dropout_scales_the_probabilities():
    """The core's output is ``(softmax(q k^T + mask) * keep) v`` (HF's and Megatron's
    ``dropout(attn_weights) @ v``), here in numpy."""
    rng = np.random.RandomState(2)
    q, k, v = (rng.randn(1, 2, 5, 4).astype(np.float32) for _ in range(3))
    mask = np.where(np.triu(np.ones((5, 5), bool), 1), np.float32(-1e9), np.float32(0))[None, None]
    keep = keep_scale(0.5, 1, 2, np.arange(50, dtype=np.uint64).reshape(1, 2, 5, 5))
    out = mm.attention.CoreAttention()(Tensor(q), Tensor(k), Tensor(v), Tensor(mask), Tensor(keep)).asnumpy()
    s = q @ k.transpose(0, 1, 3, 2) + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, (p * keep) @ v, rtol=1e-5, atol=1e-6)


def _batch(s=16):
    rng = np.random.RandomState(0)
    return (Tensor(rng.randint(0, 64, (2, s)).astype(np.int32)), Tensor(rng.randint(0, 64, (2, s)).astype(np.int32)))


def _loss_and_grads(model, step=1):
    ids, labels = _batch()
    fn = ms.value_and_grad(lambda a, b: model(a, labels=b)[0], None, model.trainable_params())
    model.dropout.begin_step(step, 5)
    loss, grads = fn(ids, labels)
    model.dropout.end_step()
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


@pytest.mark.parametrize("cfg", [CFG, QWEN3], ids=["deepseek_v3", "qwen3"])
def test_training_forward_drops_and_evaluation_does_not(cfg):
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**cfg), jit=False)
    ids, labels = _batch()
    plain = float(model(ids, labels=labels)[0].asnumpy())
    model.dropout.begin_step(1, 5)
    first = float(model(ids, labels=labels)[0].asnumpy())
    assert first != plain
    assert float(model(ids, labels=labels)[0].asnumpy()) == first  # the same step: the same masks
    model.dropout.begin_step(2, 5)
    assert float(model(ids, labels=labels)[0].asnumpy()) != first
    model.dropout.end_step()
    assert float(model(ids, labels=labels)[0].asnumpy()) == plain
    for name in ("attention_dropout", "hidden_dropout"):  # each on its own changes the loss
        ms.set_seed(0)
        one = mm.build_model(ModelConfig(**dict(cfg, **{k: 0.0 for k in ("attention_dropout", "hidden_dropout")
                                                        if k != name})), jit=False)
        one.dropout.begin_step(1, 5)
        got = float(one(ids, labels=labels)[0].asnumpy())
        assert got not in (plain, first), name


@pytest.mark.parametrize("cfg", [CFG, QWEN3], ids=["deepseek_v3", "qwen3"])
def test_compiled_and_recomputed_layers_draw_the_same_masks(cfg):
    """Compiled layers (their pieces are graphs; the masks enter between them) and activation
    recompute (full layers, and the attention core alone) give the eager run's loss and
    gradients: the masks are functions of the step and the tokens, not of a random stream."""
    ms.set_seed(0)
    ref_loss, ref_grads = _loss_and_grads(mm.build_model(ModelConfig(**cfg), jit=False))
    for jit, recompute in ((True, None), (False, RecomputeConfig(mode="full")),
                           (False, RecomputeConfig(mode="select",
                                                   select_module={"self_attn.core_attention": True}))):
        ms.set_seed(0)
        loss, grads = _loss_and_grads(mm.build_model(ModelConfig(**cfg), jit=jit, recompute=recompute))
        assert loss == pytest.approx(ref_loss, rel=1e-6), (jit, recompute)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


def test_mask_multiplies_in_the_residual_branch_dtype():
    d = Dropout(hidden=0.5)
    d.begin_step(1, 0)
    d.set_tokens(token_keys(np.zeros((1, 4), np.int32)))
    y = ops.ones((1, 4, 3), ms.float32)
    m = d.hidden_mask(0, 1, y.shape)
    assert m.dtype == ms.float32 and set(np.unique(m.asnumpy()).tolist()) <= {0.0, 2.0}
