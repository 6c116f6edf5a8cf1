"""from_pretrained / save_pretrained round trips, sharding, layouts and error messages."""

import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file, save_file

import mindtrain.models as mm
from mindtrain.config import ModelConfig, UserError

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
           num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
           qk_nope_head_dim=8, v_head_dim=8, seq_length=16, max_position_embeddings=64, num_nextn_predict_layers=1)
IDS = Tensor(np.arange(24, dtype=np.int32).reshape(2, 12) % 64)


def _model(seed=1):
    ms.set_seed(seed)
    return mm.build_model(ModelConfig(**CFG), jit=False)


def test_round_trip_single_and_sharded(tmp_path):
    model = _model()
    bias = np.linspace(-0.1, 0.1, 4).astype(np.float32)
    model.moe_routers()[0].e_score_correction_bias.set_data(Tensor(bias))
    model.save_pretrained(str(tmp_path / "one"))
    mm.save_pretrained(model, str(tmp_path / "many"), max_shard_bytes=20_000)
    files = os.listdir(tmp_path / "many")
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    names = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names  # official per-expert names
    assert "model.layers.2.shared_head.head.weight" in names
    want = model(IDS).asnumpy()
    for sub in ("one", "many"):
        loaded = mm.from_pretrained(str(tmp_path / sub), jit=False)
        np.testing.assert_array_equal(loaded(IDS).asnumpy(), want)
        np.testing.assert_array_equal(loaded.moe_routers()[0].e_score_correction_bias.asnumpy(), bias)
        for a, b in zip(loaded.get_parameters(), model.get_parameters()):
            np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_same_seed_same_weights_and_different_seed_differs():
    a, b, c = _model(7), _model(7), _model(8)
    pa, pb, pc = ([p.asnumpy() for p in m.trainable_params()] for m in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb))
    assert not np.array_equal(pa[0], pc[0])
    std = np.std(pa[0])
    assert 0.015 < std < 0.025  # normal(0, initializer_range)


def test_stacked_transformers5_layout_loads(tmp_path):
    model = _model()
    model.save_pretrained(str(tmp_path))
    t = load_file(str(tmp_path / "model.safetensors"))
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate = np.stack([t.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)])
        up = np.stack([t.pop(f"{p}.{e}.up_proj.weight") for e in range(4)])
        t[f"{p}.gate_up_proj"] = np.concatenate([gate, up], 1)
        t[f"{p}.down_proj"] = np.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    save_file(t, str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(mm.from_pretrained(str(tmp_path), jit=False)(IDS).asnumpy(), model(IDS).asnumpy())


def test_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        mm.from_pretrained(str(tmp_path))
    model = _model()
    model.save_pretrained(str(tmp_path))
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["model.layers.0.self_attn.o_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="o_proj"):
        mm.from_pretrained(str(tmp_path), jit=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError):
        mm.from_pretrained(str(tmp_path), jit=False)


def test_the_one_hf_reader_takes_shards_without_an_index_and_never_pickle(tmp_path):
    model = _model()
    model.save_pretrained(str(tmp_path))
    t = load_file(str(tmp_path / "model.safetensors"))
    os.remove(tmp_path / "model.safetensors")
    names = sorted(t)
    save_file({k: t[k] for k in names[::2]}, str(tmp_path / "part-a.safetensors"))
    save_file({k: t[k] for k in names[1::2]}, str(tmp_path / "part-b.safetensors"))
    np.testing.assert_array_equal(mm.from_pretrained(str(tmp_path), jit=False)(IDS).asnumpy(), model(IDS).asnumpy())
    for f in ("part-a.safetensors", "part-b.safetensors"):
        os.remove(tmp_path / f)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UserError, match="no model.safetensors.*never pickle .bin files"):
        mm.from_pretrained(str(tmp_path), jit=False)


def test_hf_boxes_read_any_piece_of_either_expert_layout(tmp_path):
    """HFBoxes (what a rank of a layout reads from an HF directory): any box of any parameter,
    from per-expert files (sharded, with an index) and from transformers 5's stacked
    gate_up_proj, equals that box of the model the directory was saved from."""
    from mindtrain.models.hf_checkpoint import HFBoxes

    model = _model()
    mm.save_pretrained(model, str(tmp_path / "many"), max_shard_bytes=20_000)
    tensors = {}
    for f in sorted(os.listdir(tmp_path / "many")):
        if f.endswith(".safetensors"):
            tensors.update(load_file(str(tmp_path / "many" / f)))
    # transformers 5.x in memory: experts stacked, gate and up fused on dim 1
    v5 = {k: v for k, v in tensors.items() if ".experts." not in k}
    e = CFG["n_routed_experts"]
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate = np.stack([tensors[f"{p}.{i}.gate_proj.weight"] for i in range(e)])
        up = np.stack([tensors[f"{p}.{i}.up_proj.weight"] for i in range(e)])
        v5[f"{p}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        v5[f"{p}.down_proj"] = np.stack([tensors[f"{p}.{i}.down_proj.weight"] for i in range(e)])
    (tmp_path / "v5").mkdir()
    save_file(v5, str(tmp_path / "v5" / "model.safetensors"))
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    shapes = {n: a.shape for n, a in params.items()}
    for folder in ("many", "v5"):
        boxes = HFBoxes(str(tmp_path / folder), model.config, shapes)
        boxes.check_files()
        assert sorted(boxes.names()) == sorted(params)
        for name, a in params.items():
            np.testing.assert_array_equal(boxes.read_full(name), a, err_msg=name)
        for name in ("model.layers.1.mlp.experts.up_proj", "model.layers.2.mlp.experts.down_proj",
                     "model.layers.0.self_attn.q_b_proj.weight"):
            a = params[name]
            off = tuple(n // 4 for n in a.shape)
            shape = tuple(n // 2 for n in a.shape)
            box = tuple(slice(o, o + n) for o, n in zip(off, shape))
            np.testing.assert_array_equal(boxes.read(name, off, shape), a[box], err_msg=name)
    with pytest.raises(UserError, match="has shape"):
        HFBoxes(str(tmp_path / "v5"), model.config, shapes).check_shapes([("model.norm.weight", (31,))])
