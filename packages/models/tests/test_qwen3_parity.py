"""Parity with HF transformers' Qwen3 and Qwen3-MoE (fixtures made by tools/make_qwen3_fixtures.py):
logits, loss (with HF's load-balancing loss where the config adds it) and gradients, eager and
compiled; the router's choices; checkpoints and config.json both ways."""

import json
import os
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors import safe_open

import mindtrain.models as mm
from mindtrain.config.families import moe_layer_ids

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import (TOL, check_logits_loss_grads, fixture_dir as _dir, grad_of as _grad_of,  # noqa: E402
                                load_fixture as _load)

NAMES = ["qwen3", "qwen3_tied", "qwen3_moe", "qwen3_moe_step2"]
# compiled: one dense model with biases and one MoE model (dense + sparse layers, the aux loss
# in the loss); the other two differ in what eager runs the same code for
JIT_NAMES = ["qwen3", "qwen3_moe"]


def _check(name, jit):
    model, ref = _load(name, jit)
    metrics = check_logits_loss_grads(model, ref, lm_loss_key="lm_loss")
    if "aux_loss" in ref:  # HF's load_balancing_loss_func, reported whether or not it is in the loss
        assert abs(float(metrics["load_balancing_loss"].asnumpy()) - ref["aux_loss"].item()) < TOL
        assert (ref["loss"].item() != ref["lm_loss"].item()) == model.config.output_router_logits
    else:
        assert "load_balancing_loss" not in metrics


@pytest.mark.parametrize("name", NAMES)
def test_logits_loss_grads_match_hf_eager(name):
    _check(name, jit=False)


@pytest.mark.parametrize("name", JIT_NAMES)
def test_logits_loss_grads_match_hf_compiled(name):
    _check(name, jit=True)


def test_recomputed_grouped_attention_in_row_blocks_matches_hf(monkeypatch):
    """Full recompute with the attention core in causal row blocks (eager): the grouped
    queries' core gets each key/value head repeated, and loss and gradients still match HF."""
    from mindtrain.config.schema import RecomputeConfig
    from mindtrain.models import attention

    monkeypatch.setattr(attention.CoreAttention, "row_block_elements", 16 * 4)  # blocks of 4 rows
    model, ref = _load("qwen3_moe", False)
    mm.apply_recompute(model, RecomputeConfig(mode="full"))
    assert all("construct" in layer.self_attn.core_attention.__dict__ for layer in model.model.layers)
    ids, labels, mask = (Tensor(ref[k]) for k in ("input_ids", "labels", "loss_mask"))
    params = model.trainable_params()
    names = [p.name for p in params]

    def fn(ids, labels, mask):
        return model(ids, labels=labels, loss_mask=mask)[0]

    loss, grads = ms.value_and_grad(fn, None, params)(ids, labels, mask)
    assert abs(float(loss.asnumpy()) - ref["loss"].item()) < TOL
    for key in [k for k in ref if k.startswith("grad.")]:
        np.testing.assert_allclose(_grad_of(grads, names, key[5:]).asnumpy(), ref[key], atol=TOL, rtol=0, err_msg=key)
    (_, rows, ext), = attention._EXTENTS.values()  # causal blocks: each stops at its last row
    assert rows == 4 and (ext == np.array([4, 8, 12, 16])).all()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_step2"])
def test_router_choices_match_hf(name):
    model, ref = _load(name, False)
    assert model.moe_layer_ids == moe_layer_ids(model.config) == sorted(int(k.split(".")[1]) for k in ref
                                                                         if k.startswith("topk."))
    model.record_routing(True)
    model(Tensor(ref["input_ids"]))
    for layer, router in zip(model.moe_layer_ids, model.moe_routers()):
        (idx,) = router.recorded
        np.testing.assert_array_equal(np.sort(idx.asnumpy(), -1), ref[f"topk.{layer}"])
    load = model.take_expert_load()  # no labels: not counted
    assert load.shape == (len(model.moe_layer_ids), 8) and not load.asnumpy().any()


def test_structure_follows_the_config():
    q = mm.from_pretrained(_dir("qwen3"), jit=False)
    attn = q.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 16)  # head_dim != hidden / heads
    assert tuple(attn.q_proj.weight.shape) == (64, 32) and tuple(attn.k_proj.weight.shape) == (32, 32)
    assert attn.q_proj.bias is not None and tuple(attn.q_norm.weight.shape) == (16,)
    tied = mm.from_pretrained(_dir("qwen3_tied"), jit=False)
    assert not hasattr(tied, "lm_head") and tied.output_weight() is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in {p.name for p in tied.trainable_params()}
    step2 = mm.from_pretrained(_dir("qwen3_moe_step2"), jit=False)
    assert step2.model.layers[0].self_attn.head_dim == 8  # no head_dim in config.json: hidden / heads
    assert [layer.is_moe for layer in step2.model.layers] == [False, True]
    moe = mm.from_pretrained(_dir("qwen3_moe"), jit=False)
    assert [layer.is_moe for layer in moe.model.layers] == [True, False, True]  # mlp_only_layers [1]
    moe.update_expert_bias(np.ones((2, 8), np.float32))  # no correction bias: nothing to move


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trip(name, tmp_path):
    """mindtrain writes what transformers wrote: the same tensor names and shapes, and a
    config.json that reads back into the same model (transformers' side:
    ``tools/make_qwen3_fixtures.py --only-check``)."""
    model, ref = _load(name, False)
    out = str(tmp_path / "saved")
    model.save_pretrained(out)
    shapes = {}
    for d in (_dir(name), out):
        with safe_open(os.path.join(d, "model.safetensors"), framework="np") as f:
            shapes[d] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes[out] == shapes[_dir(name)]
    with open(os.path.join(_dir(name), "config.json")) as f:
        theirs = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        ours = json.load(f)
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "attention_bias", "rms_norm_eps",
                "moe_intermediate_size", "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers",
                "norm_topk_prob", "output_router_logits", "router_aux_loss_coef", "head_dim"):
        assert ours.get(key) == theirs.get(key), key
    assert ours.get("num_experts") == theirs.get("num_local_experts")
    again = mm.from_pretrained(out, jit=False)
    assert again.config == model.config
    ids = Tensor(ref["input_ids"])
    np.testing.assert_array_equal(again(ids).asnumpy(), model(ids).asnumpy())


def test_config_round_trip():
    for name in NAMES:
        with open(os.path.join(_dir(name), "config.json")) as f:
            cfg = mm.config_from_hf(json.load(f))
        assert mm.config_from_hf(mm.config_to_hf(cfg)) == cfg
    with open(os.path.join(_dir("qwen3_moe"), "config.json")) as f:
        hf = json.load(f)
    cfg = mm.config_from_hf(hf)
    assert (cfg.n_routed_experts, cfg.mlp_only_layers, cfg.output_router_logits) == (8, [1], True)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    with open(os.path.join(_dir("qwen3"), "config.json")) as f:
        yarn = mm.config_from_hf(json.load(f)).rope_scaling
    assert yarn["rope_type"] == "yarn" and yarn["factor"] == 4.0
    # the official names: num_experts, rope_scaling; HF's defaults for what is left out
    official = {k: v for k, v in hf.items() if k not in ("num_local_experts", "rope_parameters", "norm_topk_prob")}
    official.update(num_experts=8, rope_theta=1e6, rope_scaling=None)
    cfg = mm.config_from_hf(official)
    assert cfg.n_routed_experts == 8 and cfg.norm_topk_prob is False and cfg.rope_theta == 1e6
    dense = {k: v for k, v in mm.config_to_hf(cfg).items() if k != "head_dim"}
    dense.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    assert mm.config_from_hf(dense).head_dim == 128  # Qwen3Config's default
