"""Parity with HF transformers 5.24's DeepseekV4ForCausalLM (fixtures made by
tools/make_deepseek_v4_fixtures.py): logits, loss and gradients at the DeepSeek-V3 tolerance,
the routers' and the lightning indexers' choices, checkpoints and config.json both ways, the
config's V4 rules."""

import json
import os
import sys

import numpy as np
import pytest
from mindspore import Tensor
from safetensors import safe_open

import mindtrain.models as mm
from mindtrain.config import ConfigError, ModelConfig, validate_model
from mindtrain.config.families import moe_layer_ids, v4_attention_kinds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity_fixtures import check_logits_loss_grads, fixture_dir as _dir, load_fixture as _load  # noqa: E402

NAMES = ["deepseek_v4", "deepseek_v4_ragged"]


@pytest.mark.parametrize("name", NAMES)
def test_logits_loss_grads_match_hf_eager(name):
    """The shared check on every gradient above 1e-3 (``check_logits_loss_grads``); the few
    smaller ones (final collapse, some hyper-connection bases and scales, sinks) are compared
    relatively, 1% (their absolute error is far below the shared 1e-4)."""
    model, ref = _load(name, False)
    small = {k: v for k, v in ref.items() if k.startswith("grad.") and np.abs(v).max() <= 1e-3}
    metrics = check_logits_loss_grads(model, {k: v for k, v in ref.items() if k not in small}, lm_loss_key="lm_loss")
    assert "load_balancing_loss" not in metrics  # HF's V4 adds no balance loss
    if small:
        import mindspore as ms

        ids, labels, mask = (Tensor(ref[k]) for k in ("input_ids", "labels", "loss_mask"))
        params = model.trainable_params()
        names = [p.name for p in params]
        grads = ms.grad(lambda i, l, m: model(i, labels=l, loss_mask=m)[0], None, params)(ids, labels, mask)
        for key, want in small.items():
            got = grads[names.index(key[5:])].asnumpy()
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-7, err_msg=key)
            assert np.abs(want).max() > 1e-5, key


def test_logits_loss_grads_match_hf_compiled():
    """Built compiled (the default): the shared pieces V4 runs (norms, routed and shared
    experts) run as ms.jit graphs inside the eager V4 layers, with the same results."""
    model, ref = _load("deepseek_v4_ragged", True)
    assert mm.is_compiled(model)
    check_logits_loss_grads(model, {k: v for k, v in ref.items() if not k.startswith("grad.")
                                    or np.abs(v).max() > 1e-3}, lm_loss_key="lm_loss")


@pytest.mark.parametrize("mode, modules", [("full", None), ("select", ["self_attn", "mlp.experts"])])
def test_recomputed_layers_match_hf(mode, modules):
    """Activation recompute (whole layers, or the attention and the routed experts) keeps the
    parity: the recomputed forward sees the same tables (flat tensors) and choices."""
    from mindtrain.config.schema import RecomputeConfig

    model, ref = _load("deepseek_v4_ragged", False)
    rc = RecomputeConfig(mode=mode) if modules is None else RecomputeConfig(mode=mode, select_module=modules)
    mm.apply_recompute(model, rc)
    check_logits_loss_grads(model, {k: v for k, v in ref.items() if not k.startswith("grad.")
                                    or np.abs(v).max() > 1e-3}, lm_loss_key="lm_loss")
    calls = [w.forward_calls for w in model.recompute_wrappers.values()]
    assert len(calls) == (3 if modules is None else 6) and all(c >= 2 for c in calls)  # forward, then again


def test_structure_follows_the_config():
    model, _ = _load("deepseek_v4", False)
    cfg = model.config
    assert cfg.compress_ratios == [0, 4, 8, 4] and cfg.num_hash_layers == 2 and cfg.qk_rope_head_dim == 8
    assert v4_attention_kinds(cfg) == ["sliding", "csa", "hca", "csa"]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.compress_rope_theta == 160000.0
    layers = model.model.layers
    assert [layer.self_attn.compressor is None for layer in layers] == [True, False, False, False]
    assert hasattr(layers[1].self_attn.compressor, "indexer") and not hasattr(layers[2].self_attn.compressor,
                                                                               "indexer")
    assert [type(layer.mlp.gate).__name__ for layer in layers] == ["HashRouter", "HashRouter", "ScoreTopkRouter",
                                                                    "ScoreTopkRouter"]
    assert model.moe_layer_ids == moe_layer_ids(cfg) == [0, 1, 2, 3]
    names = {p.name for p in model.trainable_params()}
    assert "model.layers.0.mlp.gate.tid2eid" not in names and "model.layers.2.mlp.gate.e_score_correction_bias" \
        not in names
    assert tuple(layers[0].attn_hc.fn.shape) == ((2 + 2) * 2, 2 * 32)


@pytest.mark.parametrize("name", NAMES)
def test_router_and_indexer_choices_match_hf(name):
    model, ref = _load(name, False)
    model.record_routing(True)
    model(Tensor(ref["input_ids"]))
    for layer, router in zip(model.moe_layer_ids, model.moe_routers()):
        (idx,) = router.recorded
        np.testing.assert_array_equal(np.sort(idx.asnumpy(), -1), ref[f"topk.{layer}"])
    indexers = model.indexers()
    assert sorted(indexers) == sorted(int(k.split(".")[1]) for k in ref if k.startswith("indexer."))
    for i, indexer in indexers.items():
        (kept,) = indexer.recorded
        np.testing.assert_array_equal(kept.asnumpy(), ref[f"indexer.{i}"] > 0.5)
    if name == "deepseek_v4":  # the indexer drops visible entries: the sparse attention is exercised
        visible = (np.arange(32)[:, None] + 1) // 4 > np.arange(8)[None, :]
        assert (ref["indexer.1"].sum(-1) < visible.sum(-1)).any()
    # the expert load counts the tokens routed (labels given) and the bias moves the learned layers only
    ids, labels = Tensor(ref["input_ids"]), Tensor(ref["labels"])
    model.record_routing(False)
    model(ids, labels=labels)
    load = model.take_expert_load().asnumpy()
    assert load.shape == (len(model.moe_layer_ids), 8) and (load.sum(1) == ids.size * 2).all()
    before = [layer.mlp.gate.e_score_correction_bias.asnumpy().copy() for layer in model.model.layers
              if hasattr(layer.mlp.gate, "e_score_correction_bias")]
    model.update_expert_bias(load)
    after = [layer.mlp.gate.e_score_correction_bias.asnumpy() for layer in model.model.layers
             if hasattr(layer.mlp.gate, "e_score_correction_bias")]
    assert all(np.abs(a - b).max() > 0 for a, b in zip(after, before))


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trip(name, tmp_path):
    """mindtrain writes what transformers wrote: the same tensor names (the released
    checkpoints' names), shapes and integer token -> experts tables, and a config.json that
    reads back into the same model (transformers' side: ``make_deepseek_v4_fixtures.py --only-check``)."""
    model, ref = _load(name, False)
    out = str(tmp_path / "saved")
    model.save_pretrained(out)
    meta = {}
    for d in (_dir(name), out):
        with safe_open(os.path.join(d, "model.safetensors"), framework="np") as f:
            meta[d] = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert meta[out] == meta[_dir(name)]
    with safe_open(os.path.join(out, "model.safetensors"), framework="np") as ours, \
            safe_open(os.path.join(_dir(name), "model.safetensors"), framework="np") as theirs:
        for key in theirs.keys():
            np.testing.assert_array_equal(ours.get_tensor(key), theirs.get_tensor(key), err_msg=key)
    with open(os.path.join(_dir(name), "config.json")) as f:
        theirs = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        ours = json.load(f)
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank",
                "layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "hc_mult", "hc_sinkhorn_iters",
                "hc_eps", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                "swiglu_limit", "scoring_func", "routed_scaling_factor", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "compress_rope_theta", "rms_norm_eps", "partial_rotary_factor"):
        assert ours.get(key) == theirs.get(key), key
    again = mm.from_pretrained(out, jit=False)
    assert again.config == model.config
    ids = Tensor(ref["input_ids"])
    np.testing.assert_array_equal(again(ids).asnumpy(), model(ids).asnumpy())


def test_released_checkpoint_names_load(tmp_path):
    """The released checkpoints' names without transformers' ``model.`` prefixes
    (``embed.weight``, ``layers.N...``, ``norm.weight``, ``hc_head_fn``) read as well."""
    from safetensors.numpy import load_file, save_file

    model, ref = _load("deepseek_v4", False)
    tensors = load_file(os.path.join(_dir("deepseek_v4"), "model.safetensors"))
    renamed = {}
    for key, arr in tensors.items():
        key = key[len("model."):] if key.startswith("model.") else key
        key = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
               "hc_head.hc_scale": "hc_head_scale"}.get(key, key)
        renamed[key] = arr
    d = tmp_path / "released"
    d.mkdir()
    save_file(renamed, str(d / "model.safetensors"))
    with open(os.path.join(_dir("deepseek_v4"), "config.json")) as f:
        (d / "config.json").write_text(f.read())
    again = mm.from_pretrained(str(d), jit=False)
    ids = Tensor(ref["input_ids"])
    np.testing.assert_array_equal(again(ids).asnumpy(), model(ids).asnumpy())


def test_config_from_hf_and_back():
    for name in NAMES:
        with open(os.path.join(_dir(name), "config.json")) as f:
            cfg = mm.config_from_hf(json.load(f))
        assert mm.config_from_hf(mm.config_to_hf(cfg)) == cfg
    # the released config's form: per-layer compress_ratios (MindFormers' too), num_hash_layers,
    # qk_rope_head_dim and a flat rope_scaling
    with open(os.path.join(_dir("deepseek_v4"), "config.json")) as f:
        hf = json.load(f)
    released = {k: v for k, v in hf.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types",
                                                          "rope_parameters", "partial_rotary_factor")}
    released.update(compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=2, qk_rope_head_dim=8,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    cfg = mm.config_from_hf(released)
    assert cfg.compress_ratios == [0, 4, 128, 4, 0] and cfg.num_hash_layers == 2 and cfg.qk_rope_head_dim == 8
    assert v4_attention_kinds(cfg) == ["sliding", "csa", "hca", "csa"]  # the MTP module's entry is not read
    validate_model(cfg)


def _v4(**kw):
    base = dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", seq_length=32, vocab_size=64,
                hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4,
                num_experts_per_tok=2, compress_ratios=[0, 4], o_groups=2, o_lora_rank=8, index_n_heads=2,
                index_head_dim=16, index_topk=2, hc_mult=2, num_hash_layers=1, max_position_embeddings=64,
                scoring_func="sqrtsoftplus")
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=4), "num_key_value_heads"),
    (dict(compress_ratios=[0]), "compress_ratios"),
    (dict(num_hash_layers=3), "num_hash_layers"),
    (dict(o_groups=3), "o_groups"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(intermediate_size=64), "intermediate_size"),
    (dict(num_nextn_predict_layers=1, compress_ratios=[0, 4, 4]), "compress_ratios"),  # MTP: sliding only
    (dict(enable_hyper_connections=False, enable_hc_head=True), "enable_hc_head"),  # MindFormers refuses it too
    (dict(experimental_attention_variant="dsa"), "experimental_attention_variant"),
    (dict(hc_sinkhorn_iters=-1), "hc_sinkhorn_iters"),
    (dict(index_head_dim=4), "index_head_dim"),
])
def test_config_errors_name_the_field(change, field):
    validate_model(_v4())
    with pytest.raises(ConfigError) as err:
        validate_model(_v4(**change))
    assert f"model.{field}" in str(err.value)


def test_fresh_model_trains_a_step():
    """Built from a config (no checkpoint): the hash tables give each token distinct experts,
    and loss and gradients are finite."""
    import mindspore as ms

    model = mm.build_model(_v4(), jit=False, seed=3)
    table = model.model.layers[0].mlp.gate.tid2eid.asnumpy()
    assert table.shape == (64, 2) and (table[:, 0] != table[:, 1]).all() and set(table.ravel()) == {0, 1, 2, 3}
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 32)).astype(np.int32))
    params = model.trainable_params()
    (loss, _), grads = ms.value_and_grad(lambda x: model(x, labels=x), None, params, has_aux=True)(ids)
    assert np.isfinite(float(loss.asnumpy())) and all(np.isfinite(g.asnumpy()).all() for g in grads)
    # the default positions are accepted, packed documents refused
    pos = np.broadcast_to(np.arange(32, dtype=np.int32), (2, 32)).copy()
    assert float(model(ids, labels=ids, position_ids=Tensor(pos))[0].asnumpy()) == float(loss.asnumpy())
    pos[1, 16:] = np.arange(16)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, labels=ids, position_ids=Tensor(pos))


def test_plan_counts_flops_and_splits():
    """The config's parameter plan counts V4's indexer and hyper-connection streams (the
    plan-equals-model check is test_plan_and_counting's); tensor parallelism splits the query
    heads (the key/value head and the indexer stay whole) and the experts; the FLOPs count the keys each
    query attends (window + compressed entries), not the whole sequence."""
    from mindtrain.config.model_plan import param_specs

    cfg = _v4(compress_ratios=[4, 8], seq_length=64, sliding_window=8, n_shared_experts=1)
    specs = {p.name: p for p in param_specs(cfg)}
    assert specs["model.layers.0.self_attn.compressor.indexer.q_b_proj.weight"].shape == (2 * 16, 24)
    assert specs["model.layers.1.self_attn.compressor.position_bias"].shape == (8, 16)
    assert specs["model.layers.0.attn_hc.fn"].shape == (8, 64) and specs["model.hc_head.hc_fn"].shape == (2, 64)
    assert specs["model.layers.0.self_attn.q_b_proj.weight"].tp == "column"
    assert specs["model.layers.0.self_attn.kv_proj.weight"].tp == "replicated"
    assert specs["model.layers.0.self_attn.compressor.indexer.q_b_proj.weight"].tp == "replicated"
    assert specs["model.layers.0.mlp.experts.up_proj"].tp == "column"
    model = mm.build_model(cfg, jit=False, empty=True)
    total, active = mm.count_parameters(cfg)
    assert total == sum(int(np.prod(p.shape)) for p in model.trainable_params())
    assert active == total - 2 * 2 * 3 * 16 * 32  # 2 of 4 experts per token in both layers
    plan = mm.parallel_plan(model)
    assert plan.params["model.layers.0.self_attn.q_b_proj.weight"].tp == "column"
    assert not plan.params["model.layers.0.mlp.gate.tid2eid"].trainable
    no_matmul = sum(p.numel for n, p in specs.items() if n.endswith(("sinks", "position_bias", ".base", ".scale",
                                                                     "hc_base", "hc_scale")))
    matmul = sum(p.numel // p.shape[0] * 2 if p.expert else p.numel for n, p in specs.items()
                 if n != "model.embed_tokens.weight" and not n.endswith("norm.weight")) - no_matmul
    keys = (8 + 2) + (8 + 64 // 8)  # csa: window + index_topk; hca: window + 64 / 8 entries
    attention = 6 * 4 * (2 * 16) * keys + 2 * 2 * 16 * (64 // 4)
    assert mm.flops_per_token(cfg) == 6 * matmul + attention


def test_mindformers_names_read_into_v4():
    """A model section in MindFormers' names (num_layers, moe_router_score_function, ...) reads
    into the V4 fields; V4's own score function is not DeepSeek-V3's fixed sigmoid, and one
    key/value head is the default."""
    from mindtrain.config.model_names import to_canonical

    base = {k: v for k, v in _v4().__dict__.items() if k not in ("num_key_value_heads", "num_hidden_layers",
                                                                  "scoring_func", "initializer_range")}
    out = to_canonical(dict(base, num_layers=2, moe_router_score_function="sqrtsoftplus", init_method_std=0.05))
    cfg = ModelConfig(**out)
    validate_model(cfg)
    assert (cfg.num_hidden_layers, cfg.scoring_func, cfg.num_key_value_heads, cfg.initializer_range) == \
        (2, "sqrtsoftplus", 1, 0.05)
    assert to_canonical(dict(base, num_hidden_layers=2, scoring_func="sqrtsoftplus"))["num_key_value_heads"] == 1


def test_v4_layouts_are_accepted_and_what_cannot_split_is_refused_in_one_line():
    """Tensor, expert, pipeline and context parallelism lay V4 out (the CP rules are in
    mindtrain-config's test_config_rules); a tensor-parallel degree that does not divide
    o_groups is refused (the grouped output projection splits by whole groups)."""
    from mindtrain.config.schema import ParallelismConfig
    from mindtrain.config.validate import validate_parallelism

    for field in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "context_parallel"):
        validate_parallelism(ParallelismConfig(**{field: 2}), _v4())
    with pytest.raises(ConfigError) as err:
        validate_parallelism(ParallelismConfig(tensor_parallel=2), _v4(o_groups=1, o_lora_rank=16))
    assert str(err.value) == ("parallelism.tensor_parallel: 2 must divide model.o_groups (1): DeepSeek-V4's "
                              "grouped output projection splits by groups")


def test_v4_plan_splits_heads_and_groups_and_keeps_the_shared_head_whole():
    """The parallel plan: q_b_proj, sinks and o_a_proj split by heads / groups (dim 0),
    o_b_proj's input (dim 1); the key/value head, the low-rank query projection, the
    compressors, the indexer, the hyper-connections and routers whole. The attention region
    divides o_groups, has no per-head mask argument; the MoE region takes the token ids; the
    hidden states between units are the hc_mult streams (mindtrain-parallel's
    test_tensor_parallel.py applies the splits)."""
    model = mm.build_model(_v4(), jit=False, empty=True)
    plan = mm.parallel_plan(model)
    a = "model.layers.1.self_attn."
    split = {n: (p.tp, p.tp_dim) for n, p in plan.params.items() if p.tp != "replicated"}
    for name, want in (("q_b_proj.weight", ("column", 0)), ("sinks", ("column", 0)),
                       ("o_a_proj.weight", ("column", 0)), ("o_b_proj.weight", ("row", 1))):
        assert split.pop(a + name) == want, name
    assert plan.params[a + "o_a_proj.weight"].split_field == "model.o_groups"
    assert not [n for n in split if ".self_attn." in n and ".layers.1." in n]  # the rest of the attention whole
    for name in ("kv_proj.weight", "q_a_proj.weight", "compressor.kv_proj.weight", "compressor.indexer.q_b_proj.weight",
                 "compressor.indexer.scorer.weights_proj.weight"):
        assert plan.params[a + name].tp == "replicated", name
    assert plan.params["model.layers.0.attn_hc.fn"].tp == plan.params["model.layers.0.mlp.gate.weight"].tp == "replicated"
    (attn,) = [r for r in plan.regions if r.path == a[:-1]]
    assert (attn.tp_counts, attn.head_mask_arg) == (("o_groups",), None)
    assert [r.token_args for r in plan.regions if r.role == "moe"] == [1, 1]
    assert plan.activation == (2, 32)
