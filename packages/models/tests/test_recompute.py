import pytest
"""Activation recompute: the recomputed layer's forward really runs again in backward (so
its activations were not kept), and losses, gradients and weights after optimizer steps
equal the run without recompute bit for bit (same ops, same order, deterministic on CPU)."""

import numpy as np


import mindspore as ms
from mindspore import Tensor, nn

import mindtrain.models as mm
from mindtrain.config import ConfigError, ModelConfig, RecomputePlan
from mindtrain.config.schema import RecomputeConfig
from mindtrain.models.recompute import Recompute

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
           n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
           q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
           max_position_embeddings=64, num_nextn_predict_layers=1, aux_loss_alpha=0.01)


def _batch():
    rng = np.random.RandomState(0)
    ids = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    labels = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    return ids, labels, Tensor(np.ones((2, 16), np.float32))


def _train(recompute, jit, steps=2, counting=None):
    """Two SGD steps; returns (losses, grads of the first step, final weights, model)."""
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**CFG), jit=jit, recompute=recompute)
    if counting is not None:
        _count_calls(model, counting)
    ids, labels, mask = _batch()
    params = model.trainable_params()
    opt = nn.SGD(params, learning_rate=0.5)

    def loss_fn():
        return model(ids, labels=labels, loss_mask=mask)[0]

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses, first = [], None
    for _ in range(steps):
        loss, grads = grad_fn()
        losses.append(loss.asnumpy())
        if first is None:
            first = [g.asnumpy() for g in grads]
        opt(grads)
    return losses, first, [p.asnumpy() for p in params], model


_BASELINE: dict = {}


def _baseline(jit):
    """The run without recompute (two steps), trained once per ``jit`` for the tests that
    compare against it (nothing changes it: it is read only)."""
    if jit not in _BASELINE:
        _BASELINE[jit] = _train(None, jit=jit)
    return _BASELINE[jit]


def _count_calls(model, counts):
    """Count the Python forward runs of every layer (eager layers)."""
    for i, layer in enumerate(model.model.layers):
        forward = type(layer).construct.__get__(layer)

        def counted(*args, _i=i, _f=forward):
            counts[_i] = counts.get(_i, 0) + 1
            return _f(*args)

        object.__setattr__(layer, "construct", counted)


def _same(a, b):
    la, ga, wa, _ = a
    lb, gb, wb, _ = b
    for x, y in zip(la + ga + wa, lb + gb + wb):
        np.testing.assert_array_equal(x, y)


def test_full_recompute_reruns_the_layer_and_changes_no_number():
    calls_off, calls_on = {}, {}
    off = _train(None, jit=False, steps=1, counting=calls_off)
    on = _train(RecomputeConfig(mode="full", full_recompute_layer=["0-1", 3]), jit=False, steps=1,
                counting=calls_on)
    # layers 0, 1 and the MTP module (3) ran twice: once without a graph, once in backward
    assert calls_off == {0: 1, 1: 1, 2: 1, 3: 1}
    assert calls_on == {0: 2, 1: 2, 2: 1, 3: 2}
    assert on[3].recompute_wrappers["model.layers.0"].forward_calls == 2
    _same(off, on)


@pytest.mark.parametrize("jit", [True, False])
def test_full_recompute_equal_over_steps(jit):
    off = _baseline(jit)
    on = _train(RecomputeConfig(mode="full"), jit=jit)
    wrappers = on[3].recompute_wrappers
    assert sorted(wrappers) == [f"model.layers.{i}" for i in range(4)]
    assert all(isinstance(w, Recompute) for w in wrappers.values())
    # two steps, each a forward and a recomputation in backward (a compiled layer's graph runs both)
    assert {k: w.forward_calls for k, w in wrappers.items()} == {k: 4 for k in wrappers}
    _same(off, on)
    # parameter names (HF names) are untouched by the wrappers
    assert [p.name for p in on[3].trainable_params()] == [p.name for p in off[3].trainable_params()]


@pytest.mark.parametrize("jit", [True, False])
def test_select_recompute_attention_core_and_experts(jit):
    rc = RecomputeConfig(mode="select", select_module={"self_attention.core_attention": ["0-2"],
                                                       "mlp.experts": True})
    off = _baseline(jit)
    on = _train(rc, jit=jit)
    wrappers = on[3].recompute_wrappers
    assert "model.layers.0.self_attn.core_attention" in wrappers
    assert "model.layers.1.mlp.experts" in wrappers and "model.layers.0.mlp.experts" not in wrappers  # dense
    if not jit:  # an eager layer calls the wrapper: forward once per step, again in backward
        assert wrappers["model.layers.0.self_attn.core_attention"].forward_calls == 4
    _same(off, on)


def test_recomputed_attention_runs_in_row_blocks(monkeypatch):
    """Eager recompute of a layer runs its attention core in blocks of query rows in backward,
    each recomputed in its own backward, so a backward never holds the [B, N, S, S] scores of
    the whole layer; the replay reuses the first pass's attention output. Same loss;
    gradients equal up to the order of the key and value gradient sums over blocks."""
    from mindtrain.models import attention

    # scores of 2 sequences x 2 heads x 16 x 16: blocks of 4 rows of one sequence and head, 16 blocks
    monkeypatch.setattr(attention.CoreAttention, "row_block_elements", 16 * 4)
    backward = attention._RowBlock.backward
    blocks: dict = {}

    def counted_backward(ctx, dout):
        key = id(ctx.core)
        blocks[key] = blocks.get(key, 0) + 1
        return backward(ctx, dout)

    monkeypatch.setattr(attention._RowBlock, "backward", staticmethod(counted_backward))
    off = _baseline(False)
    calls: dict = {}
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**CFG), jit=False, recompute=RecomputeConfig(mode="full", full_recompute_layer=[0, 3]))
    for i, layer in enumerate(model.model.layers):
        core = layer.self_attn.core_attention
        assert ("construct" in core.__dict__) == (i in (0, 3))  # only recomputed layers' cores
        attend = core.attend

        def counted(*args, _i=i, _f=attend):
            calls[_i] = calls.get(_i, 0) + 1
            return _f(*args)

        object.__setattr__(core, "attend", counted)
    ids, labels, mask = _batch()
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda: model(ids, labels=labels, loss_mask=mask)[0], None, params)()
    # recomputed layers: the forward in 16 blocks (the output kept); in backward the replay
    # takes that output, and each of the 16 blocks is computed again in its own backward;
    # the other layers' eager attention runs heads-major (attend_heads_major), not attend
    assert calls == {0: 16, 3: 16}
    cores = [layer.self_attn.core_attention for layer in model.model.layers]
    assert blocks == {id(cores[0]): 16, id(cores[3]): 16}
    assert all(not layer.self_attn.core_attention.__dict__.get("_first_pass_outputs")
               for layer in model.model.layers)  # every kept output was taken
    # causal: a block of 4 rows attends to the keys up to its last row only
    (_, rows, ext), = attention._EXTENTS.values()
    assert rows == 4 and (ext == np.array([4, 8, 12, 16])).all()
    np.testing.assert_array_equal(loss.asnumpy(), off[0][0])
    for g, ref in zip(grads, off[1]):
        np.testing.assert_allclose(g.asnumpy(), ref, rtol=1e-5, atol=1e-7)


def test_compiled_layer_with_recomputed_core_in_blocks_compiles_around_it(monkeypatch):
    """A compiled model whose recomputed attention core holds more scores than a block
    compiles that layer by pieces around the core, which runs eager in blocks (a graph
    would keep all the scores in its workspace); the other layers stay whole graphs."""
    from mindtrain.models import attention

    monkeypatch.setattr(attention.CoreAttention, "row_block_elements", 16 * 4)
    backward = attention._RowBlock.backward
    blocks = [0]

    def counted_backward(ctx, dout):
        blocks[0] += 1
        return backward(ctx, dout)

    monkeypatch.setattr(attention._RowBlock, "backward", staticmethod(counted_backward))
    off = _baseline(True)
    on = _train(RecomputeConfig(mode="full", full_recompute_layer=[0]), jit=True, steps=1)
    layers = on[3].model.layers
    assert "construct" in layers[0].self_attn.core_attention.__dict__  # eager, in blocks
    assert not layers[0].can_run_whole()  # so layer 0 runs its compiled pieces around the core
    assert {"project", "keys_values", "output"} <= set(layers[0].self_attn.compiled_pieces)
    assert all(layer.can_run_whole() and "forward" in layer.compiled_pieces for layer in layers[1:])
    assert blocks[0] == 16  # 2 sequences x 2 heads x 4 blocks of 4 rows
    np.testing.assert_allclose(on[0][0], off[0][0], rtol=1e-6)
    for g, ref in zip(on[1], off[1]):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)


def test_row_blocks_skip_only_keys_the_mask_blocks_for_every_row():
    """A block of query rows attends to keys up to its causal end when the mask blocks every
    later key of its rows and opens each row's own position (packed documents included);
    otherwise to every key (a row with no open key, a non-square mask)."""
    from mindtrain.models import attention
    from mindtrain.models.attention_mask import additive_mask

    def extents(mask, rows, square=True):
        attention._EXTENTS.clear()
        return attention._key_extents(mask, rows, square).tolist()

    causal = additive_mask(None, 2, 8, 2)  # [2, 2, 8, 8]
    assert extents(causal, 2) == [[[2, 4, 6, 8]] * 2] * 2
    docs = additive_mask(np.array([[3, 8], [8, 8]]), 2, 8, 1)  # two documents in sequence 0
    assert extents(docs, 4) == [[[4, 8]], [[4, 8]]]
    a = causal.asnumpy().copy()
    a[1, 0, 5, 7] = 0.0  # row 5 sees a later key: its block takes every key
    assert extents(Tensor(a), 2) == [[[2, 4, 6, 8]] * 2, [[2, 4, 8, 8], [2, 4, 6, 8]]]
    a = causal.asnumpy().copy()
    a[0, 1, 2, :] = -1e9  # row 2 sees nothing: softmax over all keys, so its block keeps them all
    assert extents(Tensor(a), 2) == [[[2, 4, 6, 8], [2, 8, 6, 8]], [[2, 4, 6, 8]] * 2]
    assert extents(causal, 2, square=False) == [[[8, 8, 8, 8]] * 2] * 2
    # one mask, one computation: its layers share it
    first = attention._key_extents(causal, 2, True)
    assert attention._key_extents(causal, 2, True) is first


def test_plan_grammar_and_errors():
    from mindtrain.config import layer_ids, recompute_plan

    assert layer_ids("[0-3]", 6, "f") == (0, 1, 2, 3)
    assert layer_ids(["0-1", 4, ["5"]], 6, "f") == (0, 1, 4, 5)
    assert layer_ids(True, 3, "f") == (0, 1, 2)
    assert recompute_plan(RecomputeConfig(mode="select", full_recompute_layer=[0],
                                          select_module={"mlp": ["0-1"]}), 2) == \
        RecomputePlan(full=(0,), select={"mlp": (1,)})
    with pytest.raises(ConfigError, match="recompute.full_recompute_layer: layer 7 does not exist"):
        recompute_plan(RecomputeConfig(mode="full", full_recompute_layer=["0-7"]), 4)
    with pytest.raises(ConfigError, match="recompute.select_module: is required"):
        recompute_plan(RecomputeConfig(mode="select"), 4)
    ms.set_seed(0)
    with pytest.raises(ConfigError, match="recompute.select_module.nothing: matches no module"):
        mm.build_model(ModelConfig(**CFG), jit=False,
                       recompute=RecomputeConfig(mode="select", select_module={"nothing": True}))
