"""checkpoint.layout: mindformers writes MindFormers' PyNative DeepSeek-V3 parameter names and
layouts, and reads them (and mindtrain's own names) back bit-identically."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from mindtrain.config import UserError
from mindtrain.trainer import mindformers_checkpoint as mf
from mindtrain.trainer import mindformers_names as names

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _layer(prefix: str, moe: bool) -> dict:
    """One MindFormers TransformerLayer of the tiny model, as read from MindFormers' code
    (pynative/transformers/transformer_layer.py, multi_latent_attention.py MLASelfAttention,
    mlp.py MLP, moe/moe_layer.py MoELayer, moe/experts.py GroupedMLP, moe/router.py TopKRouter,
    layers/linear.py weight (out, in)): hidden 16, q_lora 8, kv_lora 8, rope 4, nope 4, v 4,
    2 heads, dense ffn 32, 4 experts of ffn 8, one shared expert (ffn 8), gated (SwiGLU)."""
    t = {"input_layernorm.weight": (16,),
         "self_attention.linear_qkv.weight": (8 + 8 + 4, 16),
         "self_attention.q_layernorm.weight": (8,),
         "self_attention.linear_qb.weight": (2 * (4 + 4), 8),
         "self_attention.k_layernorm.weight": (8,),
         "self_attention.linear_kvb.weight": (2 * (4 + 4), 8),
         "self_attention.linear_proj.weight": (16, 2 * 4),
         "pre_mlp_layernorm.weight": (16,)}
    if moe:
        t.update({"mlp.router.weight": (4, 16), "mlp.expert_bias": (4,), "mlp.tokens_per_expert": (4,),
                  "mlp.experts.weight1": (4, 16, 2 * 8), "mlp.experts.weight2": (4, 8, 16),
                  "mlp.shared_experts.linear_fc1.weight": (2 * 8, 16),
                  "mlp.shared_experts.linear_fc2.weight": (16, 8)})
    else:
        t.update({"mlp.linear_fc1.weight": (2 * 32, 16), "mlp.linear_fc2.weight": (16, 32)})
    return {prefix + k: v for k, v in t.items()}


EXPECTED = {"embedding.word_embeddings.weight": (32, 16), "output_layer.weight": (32, 16),
            "decoder.final_layernorm.weight": (16,),
            "mtp.layers.0.enorm.weight": (16,), "mtp.layers.0.hnorm.weight": (16,),
            "mtp.layers.0.eh_proj.weight": (16, 32), "mtp.layers.0.final_layernorm.weight": (16,),
            **_layer("decoder.layers.0.", moe=False), **_layer("decoder.layers.1.", moe=True),
            **_layer("mtp.layers.0.transformer_layer.", moe=True)}


@pytest.fixture(scope="module")
def tiny():
    """(model config, network-named weights, moments) of the tiny DeepSeek-V3 with one MTP layer."""
    import mindspore as ms

    from mindtrain.models import build_model, config_from_hf

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    with open(os.path.join(FIXTURES, "mindformers_ckpt_model.json")) as f:
        model = build_model(config_from_hf(json.load(f)), jit=False)
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    rng = np.random.default_rng(1)
    state = {"step": np.array(3, np.int64)}
    for name, a in weights.items():
        state[f"exp_avg.{name}"] = rng.standard_normal(a.shape).astype(np.float32)
        state[f"exp_avg_sq.{name}"] = rng.random(a.shape).astype(np.float32)
    return model.config, weights, state


def _write(folder: str, tensors: dict, files: dict) -> None:
    os.makedirs(folder)
    for fname, arrays in tensors.items():
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, os.path.join(folder, fname))
    for fname, obj in files.items():
        with open(os.path.join(folder, fname), "w") as f:
            json.dump(obj, f)


def test_names_and_shapes_are_mindformers_pynative(tiny):
    cfg, weights, state = tiny
    tensors, _ = mf.checkpoint_files(weights, state, "ds3", 1, mf.common_info(3, 10, 4, 12), model_config=cfg)
    model = tensors["ds3-model-0000000-0000001.safetensors"]
    opt = tensors["ds3-opt-0000000-0000001.safetensors"]
    assert {k: tuple(v.shape) for k, v in model.items()} == EXPECTED
    moments = {k: v for k, v in EXPECTED.items() if not k.endswith("tokens_per_expert")}
    assert {k: tuple(v.shape) for k, v in opt.items()} == {
        "global_step": (1,), **{f"adam_m.{k}": v for k, v in moments.items()},
        **{f"adam_v.{k}": v for k, v in moments.items()}}


def test_round_trip_through_files_is_bit_identical(tiny, tmp_path):
    cfg, weights, state = tiny
    tensors, files = mf.checkpoint_files(weights, state, None, 1, mf.common_info(3, 10, 4, 12), model_config=cfg)
    folder = str(tmp_path / mf.folder_name(3))
    _write(folder, tensors, files)
    model, opt, common = mf.read_checkpoint(folder, workers=2)
    assert names.uses_mindformers_names(model)
    back, back_opt = mf.network_tensors(model, opt, cfg)
    assert set(back) == set(weights)
    for k, a in weights.items():
        assert back[k].dtype == a.dtype and np.array_equal(back[k], a), k
    assert int(back_opt["global_step"][0]) == 3 and common["global_step"] == 3
    for k, a in state.items():
        if k != "step":
            theirs = {"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}[k.split(".", 1)[0]] + "." + k.split(".", 1)[1]
            assert np.array_equal(back_opt[theirs], a), k
    # box by box, as each rank reads its pieces: every other row of linear_fc1, halves of
    # weight1 transposed, rows of linear_qkv
    boxes = mf.MindFormersBoxes(folder, cfg, {k: a.shape for k, a in weights.items()})
    boxes.check_moments(list(weights))
    assert int(boxes.read_full("step")) == 3
    for k, a in weights.items():
        box = tuple(slice(n // 3, n - n // 4) for n in a.shape)
        offset, shape = [b.start for b in box], [b.stop - b.start for b in box]
        assert np.array_equal(boxes.read(k, offset, shape), a[box]), k
        assert np.array_equal(boxes.read(f"exp_avg.{k}", offset, shape), state[f"exp_avg.{k}"][box]), k


def test_layouts_compute_what_mindformers_modules_compute(tiny):
    """The mapped tensors used as MindFormers' modules use them give mindtrain's results:
    linear_qkv split [q_rank, kv_lora_rank, rope] (MLASelfAttention.get_query_key_value_tensors),
    dense/shared linear_fc1 rows as (ffn, 2) pairs gate/up (MLP.construct), experts x @ weight1[e]
    chunked in halves gate|up, then @ weight2[e] (GroupedMLP.experts_forward)."""
    cfg, weights, _ = tiny
    mfw = names.to_mindformers(weights, cfg)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731

    qkv = x @ mfw["decoder.layers.0.self_attention.linear_qkv.weight"].T
    np.testing.assert_array_equal(qkv[:, :8], x @ weights["model.layers.0.self_attn.q_a_proj.weight"].T)
    np.testing.assert_array_equal(qkv[:, 8:], x @ weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T)

    for theirs, ours in (("decoder.layers.0.mlp.", "model.layers.0.mlp."),
                         ("decoder.layers.1.mlp.shared_experts.", "model.layers.1.mlp.shared_experts.")):
        fc1 = (x @ mfw[theirs + "linear_fc1.weight"].T).reshape(5, -1, 2)
        theirs_out = (silu(fc1[..., 0]) * fc1[..., 1]) @ mfw[theirs + "linear_fc2.weight"].T
        ours_out = (silu(x @ weights[ours + "gate_proj.weight"].T) * (x @ weights[ours + "up_proj.weight"].T)) \
            @ weights[ours + "down_proj.weight"].T
        np.testing.assert_allclose(theirs_out, ours_out, rtol=1e-5, atol=1e-6)

    w1, w2 = mfw["decoder.layers.1.mlp.experts.weight1"], mfw["decoder.layers.1.mlp.experts.weight2"]
    for e in range(4):
        g, u = np.split(x @ w1[e], 2, axis=-1)
        theirs_out = (silu(g) * u) @ w2[e]
        p = "model.layers.1.mlp.experts."
        ours_out = (silu(x @ weights[p + "gate_proj"][e].T) * (x @ weights[p + "up_proj"][e].T)) @ weights[p + "down_proj"][e].T
        np.testing.assert_allclose(theirs_out, ours_out, rtol=1e-5, atol=1e-6)


def test_checkpoints_with_mindtrain_names_still_read(tiny):
    """Written before the name map (or by MindFormers' saver on mindtrain-named Cells, the fixture)."""
    cfg, _, _ = tiny
    folder = os.path.join(FIXTURES, "mindformers_ckpt", mf.folder_name(2))
    model, opt, _ = mf.read_checkpoint(folder)
    assert not names.uses_mindformers_names(model)
    same_model, same_opt = mf.network_tensors(model, opt, cfg)
    assert same_model is model and same_opt is opt


def test_unknown_names_are_one_line_errors(tiny):
    cfg, weights, _ = tiny
    with pytest.raises(UserError, match="model.layers.0.extra.weight"):
        names.to_mindformers({**weights, "model.layers.0.extra.weight": np.zeros(1)}, cfg)
    theirs = names.to_mindformers(weights, cfg)
    with pytest.raises(UserError, match="decoder.layers.0.mlp.foo"):
        names.from_mindformers({**theirs, "decoder.layers.0.mlp.foo": np.zeros(1)}, cfg)
    with pytest.raises(UserError, match="num_nextn_predict_layers"):
        names.from_mindformers({**theirs, "mtp.layers.1.enorm.weight": np.zeros(16)}, cfg)


def test_checkpoint_saved_by_mindformers_own_deepseek_v3_loads(tiny):
    """fixtures/mindformers_ds3_ckpt: MindFormers 2.1.0's save_checkpoint of its own
    PyNativeDeepseekV3ForCausalLM (tiny config), after its load_checkpoint had filled that model
    from a checkpoint mindtrain wrote (tools/make_mindformers_checkpoint.py network). Read box by
    box under mindtrain's names, as the trainer reads it, it maps back to exactly the tensors
    MindFormers saved."""
    from mindtrain.trainer import checkpoint as ck

    cfg, weights, _ = tiny
    kind, folder = ck.resolve_checkpoint(os.path.join(FIXTURES, "mindformers_ds3_ckpt"))
    theirs, opt, common = mf.read_checkpoint(folder)
    assert kind == "mindformers" and not opt and common["global_step"] == 3
    assert {k: tuple(v.shape) for k, v in theirs.items()} == EXPECTED
    ours, _ = mf.network_tensors(theirs, opt, cfg)
    assert set(ours) == set(weights)
    shapes = {k: a.shape for k, a in weights.items()}
    boxes = mf.MindFormersBoxes(folder, cfg, shapes)  # as the trainer reads it (no metadata.json: whole files)
    boxes.check_shapes(shapes.items())
    boxes.check_files()
    assert not boxes.has_optimizer()
    loaded = {k: boxes.read_full(k) for k in shapes}
    again = names.to_mindformers(loaded, cfg, buffers=True)
    for k, a in theirs.items():
        assert np.array_equal(again[k], a if not k.endswith("tokens_per_expert") else np.zeros_like(a)), k
    # a checkpoint of another model: the first tensor whose shape differs, by both names
    other = dict(shapes, **{"model.layers.0.mlp.gate_proj.weight": (31, 16)})
    with pytest.raises(UserError, match=r"^checkpoint.load_path: 'decoder.layers.0.mlp.linear_fc1.weight' \(the "
                                        r"model's 'model.layers.0.mlp.gate_proj.weight'\) has shape \[64, 16\] in .*, "
                                        r"the model's is \[62, 16\]; the checkpoint was written for another model$"):
        mf.MindFormersBoxes(folder, cfg, other).check_shapes(other.items())
