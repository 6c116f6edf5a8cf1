"""apply_compile: compiled pieces take their weights as graph inputs, so they compute what
the eager model does whatever storage a layout gives the weights, and a layer runs whole
only while nothing inside it is wrapped."""

import numpy as np
import mindspore as ms
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.models import registry

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
           n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
           q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
           max_position_embeddings=64)


def _batch():
    rng = np.random.RandomState(0)
    return (Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32)),
            Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32)))


def test_compile_round_trip_keeps_foreign_overrides():
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**CFG))
    assert mm.is_compiled(model) == registry.DEFAULT_JIT
    mm.apply_compile(model)
    assert all("forward" in layer.compiled_pieces for layer in model.model.layers)
    assert "apply" in model.model.layers[0].input_layernorm.compiled_pieces
    mm.apply_compile(model, False)
    assert not mm.is_compiled(model)

    def foreign(*args):
        return args

    object.__setattr__(model.head_loss, "construct", foreign)
    mm.apply_compile(model)   # leaves an overridden cell alone
    mm.apply_compile(model, False)
    assert model.head_loss.__dict__["construct"] is foreign


def test_bias_update_and_weight_load_reach_compiled_layers():
    """update_expert_bias and load_hf_state_dict must change what jit layers compute."""
    cfg = ModelConfig(**CFG, bias_update_speed=0.5)
    ids, labels = _batch()
    mask = Tensor(np.ones((2, 16), np.float32))
    models = []
    for jit in (True, False):
        ms.set_seed(0)
        models.append(mm.build_model(cfg, jit=jit))
    compiled, eager = models
    before = float(compiled(ids, labels=labels, loss_mask=mask)[0].asnumpy())
    load = np.zeros((len(compiled.moe_layer_ids), 4), np.float32)
    load[:, :2] = 100.0
    for m in models:
        m.update_expert_bias(Tensor(load))
    after = [float(m(ids, labels=labels, loss_mask=mask)[0].asnumpy()) for m in models]
    assert after[0] != before
    assert after[0] == after[1]
    state = {k: v * 0.5 for k, v in mm.hf_state_dict(eager).items()}
    for m in models:
        mm.load_hf_state_dict(m, state)
    loaded = [float(m(ids, labels=labels, loss_mask=mask)[0].asnumpy()) for m in models]
    assert loaded[0] == loaded[1] != after[0]


def test_compiled_layer_follows_weights_whose_storage_is_swapped():
    """What ZeRO-3 does to a layer: its weights get new storage (set_data) between calls,
    even an empty one; a compiled layer computes with the weights it holds at each call."""
    ms.set_seed(0)
    compiled = mm.build_model(ModelConfig(**CFG), jit=True)
    ms.set_seed(0)
    eager = mm.build_model(ModelConfig(**CFG), jit=False)
    ids, labels = _batch()
    first = float(compiled(ids, labels=labels)[0].asnumpy())
    assert first == float(eager(ids, labels=labels)[0].asnumpy())
    for model in (compiled, eager):
        for p in model.model.layers[1].get_parameters():
            if p.requires_grad:
                values = p.asnumpy()
                p.set_data(Tensor(np.zeros((0,), np.float32)))  # freed
                p.set_data(Tensor(values * 0.5))  # gathered again, new storage
    params = compiled.trainable_params()
    loss_c, grads_c = ms.value_and_grad(lambda: compiled(ids, labels=labels)[0], None, params)()
    loss_e, grads_e = ms.value_and_grad(lambda: eager(ids, labels=labels)[0], None, eager.trainable_params())()
    assert float(loss_c.asnumpy()) != first
    np.testing.assert_allclose(loss_c.asnumpy(), loss_e.asnumpy(), rtol=1e-6)
    for a, b in zip(grads_c, grads_e):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-7)


def test_regions_compile_the_pieces_and_compute_what_eager_does():
    """A layer whose cells a layout wraps (Python code, as tensor parallelism installs) runs
    its compiled pieces under the wrappers; granularity="region" does so always. Loss and
    gradients equal the eager model's."""
    cfg = ModelConfig(**{**CFG, "n_shared_experts": 1, "num_nextn_predict_layers": 1})
    ids, labels = _batch()
    out = {}
    for mode in ("eager", "wrapped", "region"):
        ms.set_seed(0)
        model = mm.build_model(cfg, jit=False)
        calls = []
        if mode != "eager":
            mm.apply_compile(model, granularity="auto" if mode == "wrapped" else "region")
            for layer in model.model.layers:  # the MTP module's block too
                assert ("forward" in layer.compiled_pieces) == (mode == "wrapped")
                assert {"project", "attend", "keys_values", "output"} <= set(layer.self_attn.compiled_pieces)
                if layer.is_moe:
                    assert "forward" in layer.mlp.gate.compiled_pieces and "forward" in layer.mlp.experts.compiled_pieces
                    assert "forward" in layer.mlp.shared_experts.compiled_pieces
                else:
                    assert "forward" in layer.mlp.compiled_pieces

            def wrap(cell):
                inner = cell.construct

                def construct(*args):
                    calls.append(1)
                    return inner(*args)

                object.__setattr__(cell, "construct", construct)

            for layer in model.model.layers:
                wrap(layer.self_attn)
                if not layer.is_moe:
                    wrap(layer.mlp)
                assert not layer.can_run_whole()
        params = model.trainable_params()
        loss, grads = ms.value_and_grad(lambda i, l: model(i, labels=l)[0], None, params)(ids, labels)
        out[mode] = (float(loss.asnumpy()), [g.asnumpy() for g in grads])
        if mode != "eager":
            assert len(calls) == 4  # three attention blocks (two layers, the MTP module) and one dense MLP
    for mode in ("wrapped", "region"):
        assert abs(out[mode][0] - out["eager"][0]) <= 1e-6 * abs(out["eager"][0])
        for a, b in zip(out[mode][1], out["eager"][1]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_layers_of_one_kind_share_one_graph():
    """MindSpore compiles (and keeps the memory of) one graph per ms.jit object: the three MoE
    layers share one, the dense layer has its own, and a layout changing one layer's constants
    gets that layer a graph of its own."""
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**{**CFG, "num_hidden_layers": 4}), jit=True)
    ids, labels = _batch()
    loss = model(ids, labels=labels)[0]
    assert np.isfinite(loss.asnumpy())
    layers = model.model.layers
    graphs = [layer.graph("forward") for layer in layers]
    assert graphs[1] is graphs[2] is graphs[3] and graphs[0] is not graphs[1]
    assert len(layers[0].graph_cache) == 3  # dense layer, MoE layer, head + loss
    layers[3].self_attn.scaling = 0.5  # a constant the piece reads
    assert layers[3].graph("forward") is not graphs[1] and layers[2].graph("forward") is graphs[1]
    # a tensor constant counts by shape and dtype
    layers[2].self_attn._half_sign = Tensor(np.ones((1, 3, 1), np.float32))
    assert layers[2].graph("forward") is not graphs[1]
