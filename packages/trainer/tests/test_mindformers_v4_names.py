"""DeepSeek-V4's MindFormers PyNative names (mindtrain.trainer.mindformers_name_table): every
parameter of both attention variants (MTP modules, learned stream head) has one, and they are
the names MindFormers' own V4 weight template gives (models/deepseek4/utils.py,
``DeepseekV4PreTrainedModel.weight_converters``, transcribed below as data: the released
checkpoint's tensor name -> MindFormers' names), read through mindtrain's map from the released
names to its own (mindtrain.models.hf_v4_names.file_to_model). Muon's adamw_include globs in
MindFormers' names (the published file's ``*word_embeddings*``, ``*output_layer*``) reach V4's
embedding and head. checkpoint.layout: mindformers writes them with the shapes MindFormers'
modules declare (a hyper-connection scale as its three alphas, the int32 hash table, MindFormers'
constants) and reads them back bit-identically, whole and box by box."""

import json
import re

import numpy as np
import pytest

from mindtrain.config import ModelConfig
from mindtrain.config.model_plan import param_specs
from mindtrain.models.hf_v4_names import file_to_model
from mindtrain.trainer.mindformers_name_table import locate, mindformers_names_of
from mindtrain.trainer.muon_rules import uses_muon

# MindFormers' weight_converters for DeepSeek-V4 (commit 167a50d): released name -> MindFormers
# names (a concatenation or an expert stack lists one target per source; eh_proj's e_proj /
# h_proj concatenation is left out: mindtrain's eh_proj is one tensor)
TEMPLATE = [
    ('embed.weight', ['embedding.word_embeddings.weight']),
    ('head.weight', ['output_layer.weight']),
    ('norm.weight', ['decoder.final_layernorm.weight']),
    ('layers.{}.attn.wq_a.weight', ['decoder.layers.{}.self_attention.linear_q_down_proj.weight']),
    ('layers.{}.attn.q_norm.weight', ['decoder.layers.{}.self_attention.q_layernorm.weight']),
    ('layers.{}.attn.wq_b.weight', ['decoder.layers.{}.self_attention.linear_q_up_proj.weight']),
    ('layers.{}.attn.wkv.weight', ['decoder.layers.{}.self_attention.linear_kv_proj.weight']),
    ('layers.{}.attn.kv_norm.weight', ['decoder.layers.{}.self_attention.kv_layernorm.weight']),
    ('layers.{}.attn.wo_a.weight', ['decoder.layers.{}.self_attention.linear_o_group_proj']),
    ('layers.{}.attn.wo_b.weight', ['decoder.layers.{}.self_attention.linear_proj.weight']),
    ('layers.{}.attn.attn_sink', ['decoder.layers.{}.self_attention.core_attention.attn_sink']),
    ('layers.{}.attn.compressor.ape', ['decoder.layers.{}.self_attention.core_attention.compressor.ape']),
    ('layers.{}.attn.compressor.wkv.weight', ['decoder.layers.{}.self_attention.core_attention.compressor.linear_wkv.weight']),
    ('layers.{}.attn.compressor.wgate.weight', ['decoder.layers.{}.self_attention.core_attention.compressor.linear_wgate.weight']),
    ('layers.{}.attn.compressor.norm.weight', ['decoder.layers.{}.self_attention.core_attention.compressor.norm.weight']),
    ('layers.{}.attn.indexer.wq_b.weight', ['decoder.layers.{}.self_attention.core_attention.indexer.linear_wq_b.weight']),
    ('layers.{}.attn.indexer.weights_proj.weight', ['decoder.layers.{}.self_attention.core_attention.indexer.linear_weights_proj.weight']),
    ('layers.{}.attn.indexer.compressor.ape', ['decoder.layers.{}.self_attention.core_attention.indexer.compressor.ape']),
    ('layers.{}.attn.indexer.compressor.wkv.weight', ['decoder.layers.{}.self_attention.core_attention.indexer.compressor.linear_wkv.weight']),
    ('layers.{}.attn.indexer.compressor.wgate.weight', ['decoder.layers.{}.self_attention.core_attention.indexer.compressor.linear_wgate.weight']),
    ('layers.{}.attn.indexer.compressor.norm.weight', ['decoder.layers.{}.self_attention.core_attention.indexer.compressor.norm.weight']),
    ('layers.{}.attn_norm.weight', ['decoder.layers.{}.input_layernorm.weight']),
    ('layers.{}.ffn_norm.weight', ['decoder.layers.{}.pre_mlp_layernorm.weight']),
    ('layers.{}.ffn.gate.weight', ['decoder.layers.{}.mlp.router.weight']),
    ('layers.{}.ffn.gate.bias', ['decoder.layers.{}.mlp.expert_bias']),
    ('layers.{}.ffn.gate.tid2eid', ['decoder.layers.{}.mlp.router.tid2eid']),
    ('layers.{}.ffn.shared_experts.w1.weight', ['decoder.layers.{}.mlp.shared_experts.linear_fc1.weight']),
    ('layers.{}.ffn.shared_experts.w3.weight', ['decoder.layers.{}.mlp.shared_experts.linear_fc1.weight']),
    ('layers.{}.ffn.shared_experts.w2.weight', ['decoder.layers.{}.mlp.shared_experts.linear_fc2.weight']),
    ('layers.{}.ffn.experts.{}.w1.weight', ['decoder.layers.{}.mlp.experts.weight1']),
    ('layers.{}.ffn.experts.{}.w3.weight', ['decoder.layers.{}.mlp.experts.weight1']),
    ('layers.{}.ffn.experts.{}.w2.weight', ['decoder.layers.{}.mlp.experts.weight2']),
    ('mtp.0.enorm.weight', ['mtp.layers.0.enorm.weight']),
    ('mtp.0.hnorm.weight', ['mtp.layers.0.hnorm.weight']),
    ('mtp.0.norm.weight', ['mtp.layers.0.final_layernorm.weight']),
    ('mtp.0.attn.wq_a.weight', ['mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight']),
    ('mtp.0.attn.q_norm.weight', ['mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight']),
    ('mtp.0.attn.wq_b.weight', ['mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight']),
    ('mtp.0.attn.wkv.weight', ['mtp.layers.0.transformer_layer.self_attention.linear_kv_proj.weight']),
    ('mtp.0.attn.kv_norm.weight', ['mtp.layers.0.transformer_layer.self_attention.kv_layernorm.weight']),
    ('mtp.0.attn.wo_a.weight', ['mtp.layers.0.transformer_layer.self_attention.linear_o_group_proj']),
    ('mtp.0.attn.wo_b.weight', ['mtp.layers.0.transformer_layer.self_attention.linear_proj.weight']),
    ('mtp.0.attn.attn_sink', ['mtp.layers.0.transformer_layer.self_attention.core_attention.attn_sink']),
    ('mtp.0.attn_norm.weight', ['mtp.layers.0.transformer_layer.input_layernorm.weight']),
    ('mtp.0.ffn_norm.weight', ['mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight']),
    ('mtp.0.ffn.gate.weight', ['mtp.layers.0.transformer_layer.mlp.router.weight']),
    ('mtp.0.ffn.gate.bias', ['mtp.layers.0.transformer_layer.mlp.expert_bias']),
    ('mtp.0.ffn.shared_experts.w1.weight', ['mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight']),
    ('mtp.0.ffn.shared_experts.w3.weight', ['mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc1.weight']),
    ('mtp.0.ffn.shared_experts.w2.weight', ['mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc2.weight']),
    ('mtp.{}.ffn.experts.{}.w1.weight', ['mtp.layers.{}.transformer_layer.mlp.experts.weight1']),
    ('mtp.{}.ffn.experts.{}.w3.weight', ['mtp.layers.{}.transformer_layer.mlp.experts.weight1']),
    ('mtp.{}.ffn.experts.{}.w2.weight', ['mtp.layers.{}.transformer_layer.mlp.experts.weight2']),
    ('layers.{}.hc_attn_base', ['decoder.layers.{}.attn_hc.bias']),
    ('layers.{}.hc_attn_fn', ['decoder.layers.{}.attn_hc.mapping_proj.weight']),
    ('layers.{}.hc_attn_scale', ['decoder.layers.{}.attn_hc.alpha_pre', 'decoder.layers.{}.attn_hc.alpha_post', 'decoder.layers.{}.attn_hc.alpha_res']),
    ('layers.{}.hc_ffn_base', ['decoder.layers.{}.ffn_hc.bias']),
    ('layers.{}.hc_ffn_fn', ['decoder.layers.{}.ffn_hc.mapping_proj.weight']),
    ('layers.{}.hc_ffn_scale', ['decoder.layers.{}.ffn_hc.alpha_pre', 'decoder.layers.{}.ffn_hc.alpha_post', 'decoder.layers.{}.ffn_hc.alpha_res']),
    ('mtp.0.hc_attn_base', ['mtp.layers.0.transformer_layer.attn_hc.bias']),
    ('mtp.0.hc_attn_fn', ['mtp.layers.0.transformer_layer.attn_hc.mapping_proj.weight']),
    ('mtp.0.hc_attn_scale', ['mtp.layers.0.transformer_layer.attn_hc.alpha_pre', 'mtp.layers.0.transformer_layer.attn_hc.alpha_post', 'mtp.layers.0.transformer_layer.attn_hc.alpha_res']),
    ('mtp.0.hc_ffn_base', ['mtp.layers.0.transformer_layer.ffn_hc.bias']),
    ('mtp.0.hc_ffn_fn', ['mtp.layers.0.transformer_layer.ffn_hc.mapping_proj.weight']),
    ('mtp.0.hc_ffn_scale', ['mtp.layers.0.transformer_layer.ffn_hc.alpha_pre', 'mtp.layers.0.transformer_layer.ffn_hc.alpha_post', 'mtp.layers.0.transformer_layer.ffn_hc.alpha_res']),
    ('hc_head_base', ['decoder.hc_head.hc_base']),
    ('hc_head_fn', ['decoder.hc_head.hc_fn.weight']),
    ('hc_head_scale', ['decoder.hc_head.hc_scale']),
    ('mtp.0.hc_head_base', ['mtp.layers.0.hc_head.hc_base']),
    ('mtp.0.hc_head_fn', ['mtp.layers.0.hc_head.hc_fn.weight']),
    ('mtp.0.hc_head_scale', ['mtp.layers.0.hc_head.hc_scale']),
]

N = 3  # decoder layers: heavily compressed, compressed sparse, sliding window; one MTP module


def _cfg(**kw):
    base = dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", vocab_size=64, hidden_size=32,
                moe_intermediate_size=16, num_hidden_layers=N, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                compress_ratios=[8, 4, 0, 0], o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16,
                index_topk=2, hc_mult=2, num_hash_layers=1, num_nextn_predict_layers=1, enable_hc_head=True)
    base.update(kw)
    return ModelConfig(**base)


def _ours(released: str):
    """mindtrain's parameter of a released tensor name (``mtp.0.*``: model layer N)."""
    m = re.match(r"^mtp\.0\.(.+)$", released)
    if m:
        rest = m.group(1)
        special = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "norm.weight": "shared_head.norm.weight",
                   "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
        if rest in special:
            return f"model.layers.{N}.{special[rest]}"
        released = f"layers.{N}.{rest}"
    return file_to_model(released)[0]


def _known(cfg):
    names = {p.name for p in param_specs(cfg)}
    for i in range(N + 1):  # the buffers MindFormers keeps as parameters
        names.add(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        if i < cfg.num_hash_layers:
            names.add(f"model.layers.{i}.mlp.gate.tid2eid")
    return names


def test_names_are_mindformers_weight_template():
    cfg = _cfg()
    known = _known(cfg)
    checked = set()
    for released, theirs in TEMPLATE:
        layers = range(N) if "layers.{}" in released else [None]
        hits = 0
        for i in layers:
            name = released.replace("mtp.{}", "mtp.0").replace("layers.{}", f"layers.{i}", 1).replace("{}", "0")
            want = [t.replace("mtp.layers.{}", "mtp.layers.0").replace("{}", str(i)) for t in theirs]
            ours = _ours(name)
            if ours not in known:
                continue  # a compressor / indexer / hash table the layer's kind has none of
            assert mindformers_names_of(ours, cfg) == want, (released, ours)
            checked.add(ours)
            hits += 1
        assert hits, f"{released}: no parameter of the test model"
    # every parameter but eh_proj (MindFormers concatenates e_proj and h_proj into it) came from the template
    assert known - checked == {f"model.layers.{N}.eh_proj.weight"}
    assert locate(f"model.layers.{N}.eh_proj.weight", cfg)[0] == "mtp.layers.0.eh_proj.weight"


def test_mla_variant_takes_the_mla_attention_names():
    """The mla variant's attention is MindFormers' MLASelfAttention (linear_qkv = q_a_proj and
    kv_a_proj_with_mqa rows, linear_qb, linear_kvb, linear_proj, q/k layernorms); the rest is V4's."""
    cfg = _cfg(experimental_attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
               compress_ratios=[], enable_hc_head=False)
    got = {n: locate(n, cfg) for n in _known(cfg)}
    assert got["model.layers.0.self_attn.q_a_proj.weight"] == ("decoder.layers.0.self_attention.linear_qkv.weight", "q")
    assert got["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (
        "decoder.layers.0.self_attention.linear_qkv.weight", "kv")
    assert got["model.layers.1.self_attn.kv_b_proj.weight"][0] == "decoder.layers.1.self_attention.linear_kvb.weight"
    assert got[f"model.layers.{N}.self_attn.o_proj.weight"][0] == \
        "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight"
    assert got["model.layers.2.attn_hc.fn"][0] == "decoder.layers.2.attn_hc.mapping_proj.weight"
    assert not any(n.startswith("model.hc_head") for n in got)  # enable_hc_head false: the streams' mean
    theirs = [t for n, (t, h) in got.items() if h == "same"]
    assert len(theirs) == len(set(theirs))


def test_muon_adamw_include_in_mindformers_names_reaches_v4():
    cfg = _cfg()
    include = ["*word_embeddings*", "*output_layer*"]
    assert not uses_muon("model.embed_tokens.weight", (64, 32), include, cfg)
    assert not uses_muon("lm_head.weight", (64, 32), include, cfg)
    assert uses_muon("model.layers.0.self_attn.q_b_proj.weight", (32, 16), include, cfg)
    assert not uses_muon("model.layers.0.mlp.gate.weight", (4, 32), ["*router*"], cfg)


# ------------------------------------------------------------- checkpoint.layout: mindformers

MLA = dict(experimental_attention_variant="mla", kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
           compress_ratios=[], enable_hc_head=False)
# qk_layernorm: false (issue 34): no q_layernorm / kv_layernorm (mla: k_layernorm) tensors, q_rms_gamma stays
VARIANTS = {"dsv4_hybrid": {}, "mla": MLA, "dsv4_hybrid_no_qk_norm": dict(qk_layernorm=False),
            "mla_no_qk_norm": dict(MLA, qk_layernorm=False)}


def _mindformers_shapes(cfg) -> dict:
    """MindFormers' PyNative V4 parameters of the test model with the shapes its modules declare
    them (mindformers/pynative/...: transformers/hyper_connection.py HyperConnectionModule
    mapping_proj [n+n+n*n, n*H], bias [n+n+n*n], alpha_pre / alpha_post / alpha_res [1] each,
    rms_weight [n*H] (no gradient), HyperConnectionHead hc_fn [n, n*H], hc_base [n], hc_scale [1];
    experimental_attention_variant/deepseek_v4_hybrid_attention.py DSv4HybridSelfAttention
    (q_head_dim = v_head_dim = head_dim): linear_q_down_proj, linear_q_up_proj, linear_kv_proj
    [v, H], linear_o_group_proj [o_groups*o_lora, heads*v/o_groups], linear_proj, q_rms_gamma [v]
    (no gradient); csa.py attn_sink [heads], the compressor for ratio > 0 and the indexer for
    ratio 4; compressor.py Compressor(head_dim d): ape [ratio, c*d], linear_wkv / linear_wgate
    [c*d, H], norm [d], c = 2 for ratio 4 (overlap); indexer.py linear_wq_b [ih*ihd, q_lora],
    linear_weights_proj [ih, H]; multi_latent_attention.py MLASelfAttention for the mla variant;
    moe/router.py tid2eid [V, K] int32 in the hash layers (not MTP), moe/moe_layer.py expert_bias
    [E] (not in hash layers), tokens_per_expert [E]; moe/experts.py weight1 [E, H, 2I], weight2
    [E, I, H]; layers/linear.py weights (out, in); multi_token_prediction.py enorm, hnorm, eh_proj
    [H, 2H], final_layernorm, hc_head, transformer_layer)."""
    h, v, n, e, i, k = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.n_routed_experts,
                        cfg.moe_intermediate_size, cfg.num_experts_per_tok)
    heads, mix, q = cfg.num_attention_heads, 2 * n + n * n, cfg.q_lora_rank
    head = {"hc_head.hc_fn.weight": (n, n * h), "hc_head.hc_base": (n,), "hc_head.hc_scale": (1,)}
    out = {"embedding.word_embeddings.weight": (v, h), "output_layer.weight": (v, h),
           "decoder.final_layernorm.weight": (h,)}
    if cfg.enable_hc_head:
        out.update({"decoder." + t: s for t, s in head.items()})

    def compressor(prefix, ratio, d):
        c = 2 if ratio == 4 else 1
        return {prefix + "ape": (ratio, c * d), prefix + "linear_wkv.weight": (c * d, h),
                prefix + "linear_wgate.weight": (c * d, h), prefix + "norm.weight": (d,)}

    def layer(index, mtp):
        t = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,)}
        for hc in ("attn_hc", "ffn_hc"):
            t.update({f"{hc}.mapping_proj.weight": (mix, n * h), f"{hc}.bias": (mix,), f"{hc}.alpha_pre": (1,),
                      f"{hc}.alpha_post": (1,), f"{hc}.alpha_res": (1,), f"{hc}.rms_weight": (n * h,)})
        a = "self_attention."
        if cfg.experimental_attention_variant == "mla":
            nope, rope, vd, kv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
            t.update({a + "linear_qkv.weight": (q + kv + rope, h), a + "q_layernorm.weight": (q,),
                      a + "linear_qb.weight": (heads * (nope + rope), q), a + "k_layernorm.weight": (kv,),
                      a + "linear_kvb.weight": (heads * (nope + vd), kv), a + "linear_proj.weight": (h, heads * vd)})
        else:
            d, g, r = cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
            t.update({a + "linear_q_down_proj.weight": (q, h), a + "q_layernorm.weight": (q,),
                      a + "linear_q_up_proj.weight": (heads * d, q), a + "linear_kv_proj.weight": (d, h),
                      a + "kv_layernorm.weight": (d,), a + "linear_o_group_proj": (g * r, heads * d // g),
                      a + "linear_proj.weight": (h, g * r), a + "q_rms_gamma": (d,),
                      a + "core_attention.attn_sink": (heads,)})
            ratio = cfg.compress_ratios[index]
            if ratio:
                t.update(compressor(a + "core_attention.compressor.", ratio, d))
            if ratio == 4:
                ih, ihd = cfg.index_n_heads, cfg.index_head_dim
                t.update({a + "core_attention.indexer.linear_wq_b.weight": (ih * ihd, q),
                          a + "core_attention.indexer.linear_weights_proj.weight": (ih, h),
                          **compressor(a + "core_attention.indexer.compressor.", ratio, ihd)})
        s = cfg.n_shared_experts * i
        t.update({"mlp.router.weight": (e, h), "mlp.tokens_per_expert": (e,), "mlp.experts.weight1": (e, h, 2 * i),
                  "mlp.experts.weight2": (e, i, h), "mlp.shared_experts.linear_fc1.weight": (2 * s, h),
                  "mlp.shared_experts.linear_fc2.weight": (h, s)})
        t.update({"mlp.router.tid2eid": (v, k)} if index < cfg.num_hash_layers and not mtp else {"mlp.expert_bias": (e,)})
        if not cfg.qk_layernorm:  # IdentityOp q_layernorm / kv_layernorm (k_layernorm): no parameters
            t = {k: v for k, v in t.items() if not (k.startswith(a) and k.endswith("_layernorm.weight"))}
        return t

    for index in range(cfg.num_hidden_layers):
        out.update({f"decoder.layers.{index}.{t}": s for t, s in layer(index, False).items()})
    for j in range(cfg.num_nextn_predict_layers):
        p = f"mtp.layers.{j}."
        out.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                    p + "final_layernorm.weight": (h,)})
        out.update({p + "transformer_layer." + t: s for t, s in layer(cfg.num_hidden_layers + j, True).items()})
        if cfg.enable_hc_head:
            out.update({p + t: s for t, s in head.items()})
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def v4_model(request):
    """(model config, every weight and buffer of the built model, its AdamW state), the weights
    and moments random, the hash tables the model's own (token ids -> experts, float ids)."""
    import mindspore as ms

    from mindtrain.models import build_model

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    cfg = _cfg(**VARIANTS[request.param])
    model = build_model(cfg, jit=False)
    rng = np.random.default_rng(3)
    weights = {p.name: (p.asnumpy() if p.name.endswith("tid2eid") else rng.standard_normal(p.shape).astype(np.float32))
               for p in model.get_parameters()}
    state = {"step": np.array(4, np.int64)}
    for p in model.trainable_params():
        state[f"exp_avg.{p.name}"] = rng.standard_normal(p.shape).astype(np.float32)
        state[f"exp_avg_sq.{p.name}"] = rng.random(p.shape).astype(np.float32)
    return cfg, weights, state


def test_v4_checkpoint_holds_mindformers_tensors_and_reads_back_bit_exactly(v4_model, tmp_path):
    """checkpoint.layout: mindformers for DeepSeek-V4: the files hold exactly MindFormers' V4
    parameters with the shapes its modules declare (a hyper-connection ``scale`` [3] as its three
    [1] alphas; the hash table int32; MindFormers' constants beside: rms_weight and q_rms_gamma
    ones, tokens_per_expert zeros) and AdamW moments of the trained ones; read back, whole and box
    by box (boxes across the alphas), every weight, buffer and moment is bit-identical."""
    from mindtrain.trainer import mindformers_checkpoint as mf
    from mindtrain.trainer.sharded import write_safetensors

    cfg, weights, state = v4_model
    tensors, files = mf.checkpoint_files(weights, state, "ds4", 1, mf.common_info(4, 10, 2, 8), model_config=cfg)
    model, opt = tensors["ds4-model-0000000-0000001.safetensors"], tensors["ds4-opt-0000000-0000001.safetensors"]
    want = _mindformers_shapes(cfg)
    assert {k: tuple(a.shape) for k, a in model.items()} == want
    for k, a in model.items():
        assert a.dtype == (np.int32 if k.endswith("tid2eid") else np.float32), k
        if k.endswith(("rms_weight", "q_rms_gamma")):
            assert (a == 1).all(), k
        if k.endswith("tokens_per_expert"):
            assert not a.any(), k
    for prefix in ("decoder.layers.1.", "mtp.layers.0.transformer_layer."):
        ours = "model.layers.1." if prefix.startswith("decoder") else f"model.layers.{N}."
        for hc in ("attn_hc", "ffn_hc"):
            scale = weights[ours + hc + ".scale"]
            assert [model[f"{prefix}{hc}.{a}"][0] for a in ("alpha_pre", "alpha_post", "alpha_res")] == list(scale)
    np.testing.assert_array_equal(model["decoder.layers.0.mlp.router.tid2eid"],
                                  weights["model.layers.0.mlp.gate.tid2eid"].astype(np.int32))
    trained = {k for k in want if not k.endswith(("tid2eid", "expert_bias", "rms_weight", "q_rms_gamma",
                                                     "tokens_per_expert"))}
    assert {k: tuple(a.shape) for k, a in opt.items()} == {
        "global_step": (1,), **{f"{m}.{k}": want[k] for m in ("adam_m", "adam_v") for k in trained}}

    folder = tmp_path / mf.folder_name(4)
    folder.mkdir()
    for fname, arrays in tensors.items():
        write_safetensors(str(folder / fname), arrays.items())
    for fname, obj in files.items():
        (folder / fname).write_text(json.dumps(obj))
    back, back_opt = mf.network_tensors(*mf.read_checkpoint(str(folder))[:2], cfg)
    assert set(back) == set(weights)
    for k, a in weights.items():
        assert back[k].dtype == np.float32 and np.array_equal(back[k], a), k
    for k, a in state.items():
        if k != "step":
            kind, name = k.split(".", 1)
            assert np.array_equal(back_opt[{"exp_avg": "adam_m", "exp_avg_sq": "adam_v"}[kind] + "." + name], a), k
    # as the trainer reads it: box by box under the model's names
    shapes = {k: a.shape for k, a in weights.items()}
    boxes = mf.MindFormersBoxes(str(folder), cfg, shapes)
    boxes.check_shapes(shapes.items())
    boxes.check_files()  # the int32 table passes as the table it is
    boxes.check_moments([k.split(".", 1)[1] for k in state if k.startswith("exp_avg.")])
    assert not boxes.missing and int(boxes.read_full("step")) == 4
    for k, a in weights.items():
        assert np.array_equal(boxes.read_full(k), a), k
        box = tuple(slice(n // 3, n - n // 4) for n in a.shape)
        offset, extent = [b.start for b in box], [b.stop - b.start for b in box]
        assert np.array_equal(boxes.read(k, offset, extent), a[box]), k
        if f"exp_avg.{k}" in state:
            assert np.array_equal(boxes.read(f"exp_avg.{k}", offset, extent), state[f"exp_avg.{k}"][box]), k
    scale = weights["model.layers.2.ffn_hc.scale"]
    for lo, hi in ((0, 2), (1, 3), (1, 2), (2, 3)):  # within and across the alphas
        assert np.array_equal(boxes.read("model.layers.2.ffn_hc.scale", (lo,), (hi - lo,)), scale[lo:hi])
