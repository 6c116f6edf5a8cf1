"""set_jit switches layers between compiled and eager without touching foreign overrides."""

import mindspore as ms

import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.models import registry


def test_set_jit_round_trip_keeps_foreign_overrides():
    ms.set_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                      q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
                      max_position_embeddings=64)
    model = mm.build_model(cfg)
    assert model.jit_enabled == registry.DEFAULT_JIT
    model.set_jit(True)
    assert all("construct" in layer.__dict__ for layer in model.model.layers)
    model.set_jit(False)
    assert not model.jit_enabled
    assert all("construct" not in layer.__dict__ for layer in model.model.layers)

    def foreign(*args):
        return args

    object.__setattr__(model.head_loss, "construct", foreign)
    model.set_jit(True)   # leaves an overridden cell alone
    model.set_jit(False)
    assert model.head_loss.__dict__["construct"] is foreign


def test_bias_update_and_weight_load_reach_compiled_layers():
    """update_expert_bias and load_hf_state_dict must change what jit layers compute."""
    import numpy as np
    from mindspore import Tensor

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                      q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
                      max_position_embeddings=64, bias_update_speed=0.5)
    rng = np.random.RandomState(0)
    ids = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    labels = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
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


def test_regions_compile_the_pieces_and_compute_what_eager_does():
    """set_jit(granularity="region"): each layer's pieces are graphs, the layer forward stays
    eager (layouts wrap its cells), and loss and gradients equal the eager model's."""
    import numpy as np
    from mindspore import Tensor

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                      n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8,
                      q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, seq_length=16,
                      max_position_embeddings=64, n_shared_experts=1, num_nextn_predict_layers=1)
    rng = np.random.RandomState(0)
    ids = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    labels = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    out = {}
    for mode in ("eager", "region"):
        ms.set_seed(0)
        model = mm.build_model(cfg, jit=False)
        if mode == "region":
            model.set_jit(True, granularity="region")
            assert model.jit_granularity == "region"
            for layer in model.model.layers:  # the MTP module's block too
                assert "construct" not in layer.__dict__ and "construct" not in layer.self_attn.__dict__
                assert {"project", "attend"} <= set(layer.self_attn.__dict__)
                if layer.is_moe:
                    assert all("construct" in c.__dict__ for c in (layer.mlp.gate, layer.mlp.experts))
                    assert "forward" in layer.mlp.shared_experts.__dict__
                else:
                    assert "forward" in layer.mlp.__dict__
            # a layout's wrapper (Python code, as tensor parallelism installs) around the
            # compiled pieces: the pieces must still compile and run under it
            calls = []

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
        params = model.trainable_params()
        loss, grads = ms.value_and_grad(lambda i, l: model(i, labels=l)[0], None, params)(ids, labels)
        out[mode] = (float(loss.asnumpy()), [g.asnumpy() for g in grads])
        if mode == "region":
            assert len(calls) == 4  # three attention blocks (two layers, the MTP module) and one dense MLP
            model.set_jit(False)
            assert not model.jit_enabled and model.jit_granularity is None
            assert all("project" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert abs(out["region"][0] - out["eager"][0]) <= 1e-6 * abs(out["eager"][0])
    for a, b in zip(out["region"][1], out["eager"][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
