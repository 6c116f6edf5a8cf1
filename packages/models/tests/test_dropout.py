"""Dropout (issue 34): the counter-based masks (drop fraction, scaling, determinism, the same
mask for every split of the tokens, heads and sequence) and the models with it on (a training
step's forward differs from evaluation, which has none; compiled layers and activation
recompute draw the same masks as the eager forward). DeepSeek-V4 (both attention variants)
equals transformers' model given the same masks (tools/make_deepseek_v4_dropout_fixture.py).
The layouts themselves are proven against one process in integration_tests/
test_trainer_layouts.py, whose DeepSeek-V3 runs all train with dropout, and
integration_tests/test_v4_layouts.py, whose DeepSeek-V4 runs do too."""

import json
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

import mindspore as ms
from mindspore import Tensor, ops

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.config.schema import RecomputeConfig
from mindtrain.models.dropout import Dropout, keep_scale, token_keys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import TOL, check_grads, fixture_dir, load_fixture  # noqa: E402

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
           n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
           q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
           max_position_embeddings=64, num_nextn_predict_layers=1, aux_loss_alpha=0.01,
           attention_dropout=0.2, hidden_dropout=0.3)
V4 = dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", seq_length=16, vocab_size=64,
          hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
          head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
          compress_ratios=[4, 8], o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=2,
          sliding_window=8, hc_mult=2, hc_sinkhorn_iters=4, num_hash_layers=1, max_position_embeddings=64,
          num_nextn_predict_layers=1, attention_dropout=0.2, hidden_dropout=0.3)
"""DeepSeek-V4: a compressed sparse layer (its indexer keeping 2 of up to 4 entries) and a
heavily compressed one, each with a sliding window shorter than the sequence, then an MTP
module (sliding-window)."""
V4_MLA = dict(V4, experimental_attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
              enable_hc_head=False)
"""DeepSeek-V4's ``mla`` variant (DeepSeek-V3's attention in V4's layers) with an MTP module."""
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
    # DeepSeek-V4's keys named by id (attention_mask_at): a context-parallel chunk of queries
    # over its window halo and own keys, then the compressed entries, draws one process's
    # columns of those keys (a halo key before the sequence start is masked in the model)
    ids = np.concatenate((np.arange(8), 100 + np.arange(3)))
    one = whole.attention_mask_at(1, 4, 0, ids[None]).asnumpy()                   # [2, 4, 8, 11]
    cols = np.stack([np.concatenate((np.arange(k * 2 - 1, k * 2 + 2), 8 + np.arange(3))) for k in (1, 2)])
    part = _state(tokens[:, 2:6]).attention_mask_at(1, 2, 2, ids[cols]).asnumpy()  # [2 * 2, 2, 2, 6]
    for j, k in enumerate((1, 2)):  # heads 2, 3 (tensor parallelism), queries of chunks 1 and 2
        np.testing.assert_array_equal(part.reshape(2, 2, 2, 2, 6)[:, j], one[:, 2:, 2 * k:2 * k + 2][..., cols[j]])
    np.testing.assert_array_equal(one[..., :8], a)  # tokens' keys: the ids of attention_mask
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


@pytest.mark.parametrize("cfg", [CFG, QWEN3, V4, V4_MLA], ids=["deepseek_v3", "qwen3", "deepseek_v4", "deepseek_v4_mla"])
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


@pytest.mark.parametrize("cfg, jit, recompute", [
    (V4, True, RecomputeConfig(mode="full")),
    (V4_MLA, False, RecomputeConfig(mode="select", select_module=["self_attn", "mlp.experts"]))],
    ids=["deepseek_v4-compiled-full", "deepseek_v4_mla-select"])
def test_deepseek_v4_compiled_and_recomputed_layers_draw_the_same_masks(cfg, jit, recompute):
    """DeepSeek-V4 (its MTP module included) built compiled (the shared pieces inside its
    eager layers are graphs) with whole layers recomputed, and the mla variant with its
    attention and routed experts recomputed, give the eager run's loss and gradients with
    dropout on: the recomputed forward draws the first one's masks."""
    ms.set_seed(0)
    ref_loss, ref_grads = _loss_and_grads(mm.build_model(ModelConfig(**cfg), jit=False))
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**cfg), jit=jit, recompute=recompute)
    loss, grads = _loss_and_grads(model)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    assert model.recompute_wrappers and all(w.forward_calls >= 2 for w in model.recompute_wrappers.values())
    assert mm.is_compiled(model) == jit


def _v4_fixture(name):
    """``(model, reference, dropout reference)``: the fixture's model built with the dropout
    reference's rates (and, for the mla variant, its overrides)."""
    d = fixture_dir(name)
    drop = load_file(os.path.join(d, "dropout.safetensors"))
    over = {}
    if os.path.exists(os.path.join(d, "overrides.json")):
        with open(os.path.join(d, "overrides.json"), encoding="utf-8") as f:
            over = json.load(f)
    model, ref = load_fixture(name, False, attention_dropout=drop["attention_dropout"].item(),
                              hidden_dropout=drop["hidden_dropout"].item(), **over)
    return model, ref, drop


@pytest.mark.parametrize("name", ["deepseek_v4", "deepseek_v4_mla"])
def test_deepseek_v4_equals_transformers_with_the_same_masks(name):
    """transformers' DeepSeek-V4 (hf_deepseek_v4: sliding, compressed sparse with the
    indexer, heavily compressed, sinks, hyper-connections; hf_deepseek_v4_mla: the mla
    variant) in training mode with mindtrain's masks of the same step and seed: attention
    dropout on the probabilities after the softmax (V4's: the sink's column dropped first,
    the compressed entries keyed apart from the tokens), hidden dropout on the attention and
    MoE outputs before the streams' update. Logits, loss and every gradient above 1e-3 at the
    parity tolerance; outside the step the model is the fixture's (no dropout)."""
    model, ref, drop = _v4_fixture(name)
    ids, labels, mask = (Tensor(ref[k]) for k in ("input_ids", "labels", "loss_mask"))
    np.testing.assert_allclose(model(ids).asnumpy(), ref["logits"], atol=TOL, rtol=0)
    assert abs(drop["loss"].item() - ref["loss"].item()) > 1e-2  # the masks matter

    params = model.trainable_params()
    names = [p.name for p in params]
    model.dropout.begin_step(int(drop["step"].item()), int(drop["seed"].item()))
    np.testing.assert_allclose(model(ids).asnumpy(), drop["logits"], atol=TOL, rtol=0)
    fn = ms.value_and_grad(lambda i, l, m: model(i, labels=l, loss_mask=m)[0], None, params)
    loss, grads = fn(ids, labels, mask)
    model.dropout.end_step()
    assert abs(float(loss.asnumpy()) - drop["loss"].item()) < TOL
    check_grads(grads, names, {k: v for k, v in drop.items() if k.startswith("grad.") and np.abs(v).max() > 1e-3})
    np.testing.assert_allclose(model(ids).asnumpy(), ref["logits"], atol=TOL, rtol=0)
