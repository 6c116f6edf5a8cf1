"""The fast-kernel switch: portable by default, one clear error on CPU, one module.

The fused kernels have no CPU implementation, so their glue (padding, masks, expert
permutation) is checked here with stand-ins written from the kernels' documented semantics;
the kernels themselves are unverified on this machine.
"""

import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import mindtrain.models as mm
from mindtrain.config import ModelConfig, UserError
from mindtrain.models import kernels
from mindtrain.models.attention_mask import additive_mask
from mindtrain.models.experts import RoutedExperts

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
           num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
           qk_nope_head_dim=8, v_head_dim=8, seq_length=16, max_position_embeddings=64)
IDS = Tensor(np.random.RandomState(0).randint(0, 64, (2, 16)).astype(np.int32))


def _switchable(model):
    return [c for _, c in model.cells_and_names() if hasattr(type(c), "fast_kernels")]


def test_portable_path_by_default_on_cpu():
    assert not mm.fast_kernels_enabled()
    model = mm.build_model(ModelConfig(**CFG), jit=False)
    cells = _switchable(model)
    assert len(cells) >= 10 and not any(c.fast_kernels for c in cells)
    assert np.isfinite(model(IDS).asnumpy()).all()


def test_enabling_on_cpu_is_one_clear_error():
    with pytest.raises(mm.FastKernelsUnavailable) as err:
        mm.use_fast_kernels(True)
    assert isinstance(err.value, UserError)
    msg = str(err.value)
    assert "\n" not in msg and "CPU" in msg and "FlashAttentionScore" in msg
    assert not mm.fast_kernels_enabled()


def test_switch_routes_every_layer_to_the_fused_kernels():
    # claim an Ascend device to get past the guard: the model then really calls RmsNorm,
    # which MindSpore 2.10 rejects on CPU with an error (not a silent fallback)
    mm.use_fast_kernels(True, device="Ascend")
    try:
        model = mm.build_model(ModelConfig(**CFG), jit=False, compute_dtype="float16")
    finally:
        mm.use_fast_kernels(False)
    assert all(c.fast_kernels for c in _switchable(model))
    with pytest.raises(RuntimeError, match="RmsNorm"):
        model(IDS).asnumpy()
    # the switch is read when a model is built: one built now is portable again
    assert np.isfinite(mm.build_model(ModelConfig(**CFG), jit=False, compute_dtype="float16")(IDS).asnumpy()).all()


def test_fused_ops_are_called_only_from_the_kernels_module():
    src = os.path.dirname(kernels.__file__)
    for name in sorted(os.listdir(src)):
        if name.endswith(".py") and name != "kernels.py":
            text = open(os.path.join(src, name), encoding="utf-8").read()
            for op in kernels.FAST_OPS:
                assert f"ops.{op}" not in text and f"import {op}" not in text, (name, op)


# ----------------------------------------------------------------------------- glue with stand-ins
def _grouped_matmul_standin(x, weight, group_list):
    """GroupedMatmul as documented (split_item=3, group_type=0): rows [end_{e-1}, end_e) of x
    times weight[e]."""
    ends = group_list.asnumpy()
    rows = np.arange(x.shape[0])
    y = None
    for e, end in enumerate(ends):
        start = 0 if e == 0 else ends[e - 1]
        keep = Tensor(((rows >= start) & (rows < end)).astype(np.float32).reshape(-1, 1))
        part = ops.matmul(x * keep, weight[e])
        y = part if y is None else y + part
    return y


def _swiglu_standin(gate, up):
    return ops.silu(gate) * up


def test_grouped_expert_permutation_matches_portable_experts():
    ms.set_seed(0)
    experts = RoutedExperts(4, 8, 6, init_std=0.5, block=4)
    rng = np.random.RandomState(1)
    t, k = 10, 2
    x = Tensor(rng.randn(t, 8).astype(np.float32))
    idx = np.stack([rng.choice(4, k, replace=False) for _ in range(t)]).astype(np.int32)
    idx[:, 0] = np.where(idx[:, 0] == 3, 0, idx[:, 0])   # expert 3 gets few (maybe no) tokens
    idx[:, 1] = np.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % 3, idx[:, 1])
    idx = Tensor(idx)
    w = Tensor(rng.rand(t, k).astype(np.float32))
    weights = [experts.gate_proj, experts.up_proj, experts.down_proj]

    def portable(x, w):
        return experts(x, idx, w)[0].sum() * 1.0 + (experts(x, idx, w)[0] ** 2).sum()

    def fused(x, w):
        y = kernels.fast_routed_experts(x, idx, w, *weights, gmm=_grouped_matmul_standin, swiglu=_swiglu_standin)[0]
        return y.sum() * 1.0 + (y ** 2).sum()

    y_ref, c_ref = experts(x, idx, w)
    y, c = kernels.fast_routed_experts(x, idx, w, *weights, gmm=_grouped_matmul_standin, swiglu=_swiglu_standin)
    np.testing.assert_allclose(y.asnumpy(), y_ref.asnumpy(), atol=1e-5)
    np.testing.assert_array_equal(c.asnumpy(), c_ref.asnumpy())
    g_ref = ms.grad(portable, (0, 1), weights)(x, w)
    g = ms.grad(fused, (0, 1), weights)(x, w)
    for a, b in zip(g[0] + g[1], g_ref[0] + g_ref[1]):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), atol=1e-4)


def _flash_standin(q, k, v, head_num, attn_mask=None, keep_prob=1.0, scalar_value=1.0, input_layout="BSH",
                   sparse_mode=0):
    """FlashAttentionScore as documented for what the fast path passes: BNSD, sparse_mode 0,
    attn_mask 1 = discard, one head size (a multiple of 16) for q, k and v."""
    assert input_layout == "BNSD" and sparse_mode == 0 and keep_prob == 1.0 and head_num == q.shape[1]
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 16 == 0
    assert attn_mask.dtype == ms.uint8 and attn_mask.shape[1] == 1
    scores = ops.BatchMatMul(transpose_b=True)(q, k) * scalar_value
    blocked = ops.broadcast_to(attn_mask.astype(ms.bool_), scores.shape)
    probs = ops.softmax(ops.masked_fill(scores, blocked, Tensor(-1e30, scores.dtype)), -1)
    return ops.BatchMatMul()(probs, v)


def test_flash_attention_padding_and_packed_mask_match_portable():
    rng = np.random.RandomState(2)
    b, n, s, dqk, dv = 2, 3, 8, 12, 8          # head sizes differ and are not multiples of 16
    q, k = (Tensor(rng.randn(b, n, s, dqk).astype(np.float32)) for _ in range(2))
    v = Tensor(rng.randn(b, n, s, dv).astype(np.float32))
    ends = Tensor(np.array([[3, 8, 8], [5, 8, 8]], np.int32))   # packed documents, compressed EOD form
    mask_add = additive_mask(ends, b, s, n)
    ref = ops.BatchMatMul()(ops.softmax(ops.BatchMatMul(transpose_b=True)(q, k) + mask_add, -1), v)
    out = kernels.fast_attention(q, k, v, mask_add, kernel=_flash_standin)
    assert out.shape == (b, n, s, dv)
    np.testing.assert_allclose(out.asnumpy(), ref.asnumpy(), atol=1e-5)
