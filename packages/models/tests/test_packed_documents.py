"""Packed samples: with either mask form, each document's logits equal running it alone."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ModelConfig


def _model():
    ms.set_seed(11)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                      kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                      seq_length=20, max_position_embeddings=64, initializer_range=0.1,
                      num_nextn_predict_layers=0)
    return mm.build_model(cfg, jit=False)


def _megatron_mask(bounds, s):
    """Megatron's create_attention_mask with reset_attention_mask: [1,1,S,S], True = masked."""
    allowed = np.tril(np.ones((s, s), bool))
    for end in bounds:
        allowed[end:, :end] = False
    return ~allowed[None, None]


@pytest.mark.parametrize("form", ["full", "compressed"])
def test_documents_do_not_see_each_other(form):
    model = _model()
    s, ends = 20, [7, 15]
    ids = np.random.default_rng(2).integers(2, 64, (1, s)).astype(np.int32)
    pos = np.concatenate([np.arange(7), np.arange(8), np.arange(5)]).astype(np.int32)[None]
    if form == "full":
        mask = Tensor(_megatron_mask(ends, s).astype(np.uint8))
    else:
        mask = Tensor(np.array([ends + [s] * 6], np.int32))  # eod_pad_length 8, padded with S
    packed = model(Tensor(ids), position_ids=Tensor(pos), attention_mask=mask).asnumpy()
    for lo, hi in [(0, 7), (7, 15), (15, 20)]:
        alone = model(Tensor(ids[:, lo:hi])).asnumpy()
        np.testing.assert_allclose(packed[:, lo:hi], alone, atol=2e-5)
    # without the mask the later documents do see earlier tokens
    leaky = model(Tensor(ids), position_ids=Tensor(pos)).asnumpy()
    assert np.abs(leaky[:, 7:15] - packed[:, 7:15]).max() > 1e-3
