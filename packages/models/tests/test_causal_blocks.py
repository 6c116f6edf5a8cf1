"""Causal attention by row blocks (issue 33): each block of query rows attends to the keys up
to its last row only; the mask blocks are cut on the host from the causal mask. Compared
against the whole [S, S] attention (the form the HF parity tests check), eager and inside a
compiled piece; a mask that is not the causal one (packed documents, context-parallel rows)
gets no blocks, also after a graph was compiled with them."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.config.plan import causal_block_elements
from mindtrain.models import attention
from mindtrain.models.attention_mask import additive_mask

S = 256  # two blocks of 128 rows: the shortest sequence that is split


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(Tensor(rng.standard_normal(shape).astype(np.float32))
                 for shape in ((2, 2, S, 8), (2, 2, S, 8), (2, 2, S, 4), (2, 2, S, 4)))


def test_blocks_are_cut_from_the_causal_mask_only():
    causal = additive_mask(None, 2, S, 2)
    blocks = attention.causal_blocks(causal)
    assert [tuple(b.shape) for b in blocks] == [(2, 2, 128, 128), (2, 2, 128, 256)]
    m = causal.asnumpy()
    np.testing.assert_array_equal(blocks[0].asnumpy(), m[:, :, :128, :128])
    np.testing.assert_array_equal(blocks[1].asnumpy(), m[:, :, 128:, :])
    assert attention.causal_blocks(additive_mask(None, 2, S, 2)) is blocks  # one tuple per shape
    docs = additive_mask(np.array([[100, S], [S, S]], np.int32), 2, S, 2)  # two documents in sequence 0
    assert attention.causal_blocks(docs) is None
    assert attention.causal_blocks(Tensor(m[:, :, :128])) is None  # one rank's rows (context parallel)
    assert attention.causal_blocks(additive_mask(None, 2, 128, 2)) is None  # one block: not split
    assert attention.causal_block_rows(4096) == 512 and attention.causal_block_rows(512) == 128
    # mindtrain-estimate's count of the blocks' elements is what the model cuts (per plane)
    assert sum(b.size for b in blocks) == 2 * 2 * causal_block_elements(S)
    assert causal_block_elements(512) == 128 * 128 * (1 + 2 + 3 + 4) and causal_block_elements(128) == 0


def test_an_eager_model_builds_no_blocks():
    """No core of an eager model reads causal blocks, so planning its attention cuts none
    (they would hold (G + 1) / 2G of the mask again for nothing)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                      q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=384,
                      max_position_embeddings=768, num_nextn_predict_layers=0)
    mask = additive_mask(None, 3, 384, 2)  # a shape no other test plans
    key = (3, 2, 384, 384, attention.causal_block_rows(384))
    attention._CAUSAL_BLOCKS.pop(key, None)  # pylint: disable=protected-access
    mm.build_model(cfg, jit=False).plan_attention(mask)
    assert key not in attention._CAUSAL_BLOCKS  # pylint: disable=protected-access
    mm.build_model(cfg, jit=True).plan_attention(mask)
    assert key in attention._CAUSAL_BLOCKS  # pylint: disable=protected-access


@pytest.mark.parametrize("how", ["eager", "compiled_piece"])
def test_blocks_equal_the_whole_attention(how):
    q, k, v, dout = _qkv()
    mask = additive_mask(None, 2, S, 2)
    whole = attention.CoreAttention()

    def grads(fn):
        return ms.value_and_grad(lambda a, b, c: (fn(a, b, c) * dout).sum(), grad_position=(0, 1, 2))(q, k, v)

    ref_loss, ref = grads(lambda a, b, c: whole(a, b, c, mask))
    core = attention.CoreAttention()
    object.__setattr__(core, "causal_blocks", attention.causal_blocks(mask))
    calls = []
    split = core._attend_causal

    def counted(*args):
        calls.append(1)
        return split(*args)

    if how == "eager":
        object.__setattr__(core, "_attend_causal", counted)
        loss, got = grads(lambda a, b, c: core(a, b, c, mask))
        assert calls  # the Python math took the blocks
    else:
        def attend(a, b, c, m):
            return core(a, b, c, m)

        piece = ms.jit(attend)
        loss, got = grads(lambda a, b, c: piece(a, b, c, mask))
    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), rtol=1e-5)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.asnumpy(), r.asnumpy(), rtol=1e-4, atol=1e-5)


def test_a_compiled_model_follows_the_mask_it_gets():
    """The same compiled model on the causal mask (blocks), on packed documents (no blocks: a
    graph compiled with the blocks must not run) and on the causal mask again, each equal to
    the eager model, whose cores get no blocks (eager row slices are slower)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                      q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=S,
                      max_position_embeddings=2 * S, num_nextn_predict_layers=0)
    rng = np.random.RandomState(0)
    ids = Tensor(rng.randint(0, 64, (2, S)).astype(np.int32))
    labels = Tensor(rng.randint(0, 64, (2, S)).astype(np.int32))
    docs = np.array([[100, S], [S, S]], np.int32)

    def run(model, attention_mask):
        params = model.trainable_params()
        loss, grads = ms.value_and_grad(lambda: model(ids, labels=labels, attention_mask=attention_mask)[0],
                                        None, params)()
        return loss.asnumpy(), [g.asnumpy() for g in grads]

    ms.set_seed(0)
    compiled = mm.build_model(cfg, jit=True)
    ms.set_seed(0)
    plain = mm.build_model(cfg, jit=False)
    cores = [layer.self_attn.core_attention for layer in compiled.model.layers]
    for attention_mask, split in ((None, True), (docs, False), (None, True)):
        got = run(compiled, attention_mask)
        assert all((c.causal_blocks is not None) == split for c in cores)
        ref = run(plain, attention_mask)
        assert all(layer.self_attn.core_attention.causal_blocks is None for layer in plain.model.layers)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
        for g, r in zip(got[1], ref[1]):
            np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-6)
    # a core that runs the device's fused attention kernel gets none (it would never read them)
    mask = additive_mask(None, 2, S, 2)
    cores[0].fast_kernels, cores[0].matmul_dtype = True, ms.float16
    compiled.plan_attention(mask)
    assert cores[0].causal_blocks is None
    cores[0].fast_kernels, cores[0].matmul_dtype = False, None
    compiled.plan_attention(mask)
    assert cores[0].causal_blocks is not None
    # a core a layout runs its own way (its forward replaced, as Ulysses does) gets none
    object.__setattr__(cores[0], "construct", cores[0].untracked)
    compiled.plan_attention(mask)
    assert cores[0].causal_blocks is None
