"""DeepSeek-V4's MindFormers PyNative names (mindtrain.trainer.mindformers_name_table): every
parameter of both attention variants (MTP modules, learned stream head) has one, and they are
the names MindFormers' own V4 weight template gives (models/deepseek4/utils.py,
``DeepseekV4PreTrainedModel.weight_converters``, transcribed below as data: the released
checkpoint's tensor name -> MindFormers' names), read through mindtrain's map from the released
names to its own (mindtrain.models.hf_v4_names.file_to_model). Muon's adamw_include globs in
MindFormers' names (the published file's ``*word_embeddings*``, ``*output_layer*``) reach V4's
embedding and head."""

import re

import pytest

from mindtrain.config import ModelConfig, UserError
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


def test_mindformers_checkpoint_layout_is_refused_for_v4_in_one_line():
    from mindtrain.trainer.mindformers_names import placement

    with pytest.raises(UserError) as err:
        placement("model.layers.0.attn_hc.scale", (3,), _cfg())
    assert str(err.value).startswith("checkpoint.layout: mindformers is not built for DeepSeek-V4")
