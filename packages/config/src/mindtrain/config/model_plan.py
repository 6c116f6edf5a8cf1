"""The parameters a ``ModelConfig`` describes (DeepSeek-V3, DeepSeek-V4, Qwen3, Qwen3-MoE) and its training
FLOPs, as plain data.

One description of the model's trainable parameters, written once, without MindSpore: each
parameter's name (the model's, which are HF's), shape, tensor-parallel split and pipeline
unit. mindtrain-models builds exactly these (its tests build the model and compare), counts
them (``count_parameters``) and gives its parallel plan the same splits (:func:`tp_split`);
mindtrain-estimate sizes every layout from them. :func:`flops_per_token` is the one FLOP
convention (the step line's throughput and the estimate).

Weights are HF-shaped ``[out, in]``; routed experts are stacked ``[E, out, in]``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from mindtrain.config.families import QWEN3_FAMILIES, head_dim, moe_layer_ids, v4_attention_kinds
from mindtrain.config.plan import UnitPlan
from mindtrain.config.schema import ModelConfig

# (name pattern, tensor-parallel style, split dim); the first match wins
TP_RULES: tuple[tuple[str, str, Optional[int]], ...] = (
    (r"^model\.embed_tokens\.weight$", "vocab", 0),
    (r"^lm_head\.weight$", "column", 0),
    (r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj|k_proj|v_proj)\.weight$", "column", 0),
    (r"\.self_attn\.(q_proj|k_proj|v_proj)\.bias$", "column", 0),
    (r"\.self_attn\.o_proj\.weight$", "row", 1),
    (r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", "column", 0),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", "row", 1),
    (r"\.mlp\.experts\.(gate_proj|up_proj)$", "column", 1),
    (r"\.mlp\.experts\.down_proj$", "row", 2),
)
_EXPERT = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def tp_split(name: str) -> tuple[str, Optional[int]]:
    """(style, dim) of parameter ``name`` under tensor parallelism: "column" splits the output
    dim, "row" the input dim, "vocab" the vocabulary rows; low-rank down projections, norms
    (Qwen3's per-head q_norm / k_norm included), the router, ``eh_proj`` and the biases of
    row-split or replicated projections stay whole ("replicated", None); the biases of
    column-split projections (Qwen3's q/k/v) split with them."""
    for pattern, style, dim in TP_RULES:
        if re.search(pattern, name):
            return style, dim
    return "replicated", None


def is_expert(name: str) -> bool:
    """A routed-expert weight, stacked over the experts on dim 0."""
    return bool(_EXPERT.search(name))


def unit_of(name: str, num_hidden_layers: int) -> str:
    """The unit (what FSDP wraps, what a pipeline stage holds) of parameter ``name``:
    ``embedding``, ``layers.N``, ``head`` (final norm and lm_head) or ``mtp.K`` (model layer
    ``num_hidden_layers + K``)."""
    m = _LAYER.match(name)
    if m:
        idx = int(m.group(1))
        return f"layers.{idx}" if idx < num_hidden_layers else f"mtp.{idx - num_hidden_layers}"
    return "embedding" if name.startswith("model.embed_tokens.") else "head"


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter: its name and shape, its tensor-parallel split
    (:func:`tp_split`), whether it is a stacked routed-expert weight, and its unit."""

    name: str
    shape: tuple[int, ...]
    tp: str = "replicated"
    tp_dim: Optional[int] = None
    expert: bool = False
    unit: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _layer_shapes(m: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of model layer ``i``'s parameters (an MTP module when
    ``i >= num_hidden_layers``), in the model's order."""
    h, n = m.hidden_size, m.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    kv_a = m.kv_lora_rank + m.qk_rope_head_dim
    bias = bool(m.attention_bias)
    a = "self_attn."
    out: list[tuple[str, tuple[int, ...]]] = []
    if m.q_lora_rank:
        out.append((a + "q_a_proj.weight", (m.q_lora_rank, h)))
        if bias:
            out.append((a + "q_a_proj.bias", (m.q_lora_rank,)))
        if m.qk_layernorm:  # false: no latent norms (MindFormers' IdentityOp)
            out.append((a + "q_a_layernorm.weight", (m.q_lora_rank,)))
        out.append((a + "q_b_proj.weight", (n * qk, m.q_lora_rank)))
    else:
        out.append((a + "q_proj.weight", (n * qk, h)))
    out.append((a + "kv_a_proj_with_mqa.weight", (kv_a, h)))
    if bias:
        out.append((a + "kv_a_proj_with_mqa.bias", (kv_a,)))
    if m.qk_layernorm:
        out.append((a + "kv_a_layernorm.weight", (m.kv_lora_rank,)))
    out += [(a + "kv_b_proj.weight", (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
            (a + "o_proj.weight", (h, n * m.v_head_dim))]
    if bias:
        out.append((a + "o_proj.bias", (h,)))
    if i < m.first_k_dense_replace:
        out += [("mlp.gate_proj.weight", (m.intermediate_size, h)), ("mlp.up_proj.weight", (m.intermediate_size, h)),
                ("mlp.down_proj.weight", (h, m.intermediate_size))]
    else:
        e, im = m.n_routed_experts, m.moe_intermediate_size
        out += [("mlp.gate.weight", (e, h)), ("mlp.experts.gate_proj", (e, im, h)),
                ("mlp.experts.up_proj", (e, im, h)), ("mlp.experts.down_proj", (e, h, im))]
        if m.n_shared_experts:
            si = im * m.n_shared_experts
            out += [("mlp.shared_experts.gate_proj.weight", (si, h)), ("mlp.shared_experts.up_proj.weight", (si, h)),
                    ("mlp.shared_experts.down_proj.weight", (h, si))]
    out += [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    if i >= m.num_hidden_layers:
        out += [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                ("shared_head.norm.weight", (h,))]
    return [(f"model.layers.{i}.{name}", shape) for name, shape in out]


def _qwen3_layer_shapes(m: ModelConfig, i: int, moe: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of Qwen3 / Qwen3-MoE decoder layer ``i``'s parameters, in the model's
    (HF's) order: q/k/v/o projections (with biases under attention_bias), the per-head q and
    k norms (none under qk_layernorm: false), the dense MLP or the router and stacked experts, the two layer norms."""
    h, n, kv, d = m.hidden_size, m.num_attention_heads, m.num_key_value_heads, head_dim(m)
    bias = bool(m.attention_bias)
    out: list[tuple[str, tuple[int, ...]]] = []
    for proj, rows in (("q_proj", n * d), ("k_proj", kv * d), ("v_proj", kv * d)):
        out.append((f"self_attn.{proj}.weight", (rows, h)))
        if bias:
            out.append((f"self_attn.{proj}.bias", (rows,)))
    out.append(("self_attn.o_proj.weight", (h, n * d)))
    if bias:
        out.append(("self_attn.o_proj.bias", (h,)))
    if m.qk_layernorm:  # false: no per-head norms (MindFormers' IdentityOp)
        out += [("self_attn.q_norm.weight", (d,)), ("self_attn.k_norm.weight", (d,))]
    if moe:
        e, im = m.n_routed_experts, m.moe_intermediate_size
        out += [("mlp.gate.weight", (e, h)), ("mlp.experts.gate_proj", (e, im, h)),
                ("mlp.experts.up_proj", (e, im, h)), ("mlp.experts.down_proj", (e, h, im))]
    else:
        out += [("mlp.gate_proj.weight", (m.intermediate_size, h)), ("mlp.up_proj.weight", (m.intermediate_size, h)),
                ("mlp.down_proj.weight", (h, m.intermediate_size))]
    out += [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    return [(f"model.layers.{i}.{name}", shape) for name, shape in out]


def _v4_layer_shapes(m: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of DeepSeek-V4 decoder layer ``i``'s trainable parameters, in the model's
    (HF's) order (a cell's own parameters before its sub-cells'): the attention (without its query latent and
    key/value norms under ``qk_layernorm: false``; its compressor and, compressed sparse, the indexer), the MoE
    (router weight, stacked experts, shared expert; the correction bias and the token ->
    experts table are not trained), the two norms, the two hyper-connections (none under ``enable_hyper_connections: false``)."""
    h, n, d, qr = m.hidden_size, m.num_attention_heads, m.head_dim, m.q_lora_rank
    g, orank, hc = m.o_groups, m.o_lora_rank, m.hc_mult
    mla = m.experimental_attention_variant == "mla"
    # the mla variant's attention is DeepSeek-V3's; an MTP module's hybrid attention is sliding-window
    kind = "mla" if mla else v4_attention_kinds(m)[i] if i < m.num_hidden_layers else "sliding"
    a = "self_attn."
    if mla:
        out = [(name[len(f"model.layers.{i}."):], shape) for name, shape in _layer_shapes(m, i)
               if ".self_attn." in name]
    else:
        # qk_layernorm: false: no q_a_norm / kv_norm (MindFormers' IdentityOp q_layernorm / kv_layernorm)
        norm = m.qk_layernorm
        out = [(a + "sinks", (n,)), (a + "q_a_proj.weight", (qr, h))] + ([(a + "q_a_norm.weight", (qr,))] if norm else [])
        out += [(a + "q_b_proj.weight", (n * d, qr)), (a + "kv_proj.weight", (d, h))]
        out += [(a + "kv_norm.weight", (d,))] if norm else []
        out += [(a + "o_a_proj.weight", (g * orank, n * d // g)), (a + "o_b_proj.weight", (h, g * orank))]

    def pooling(prefix: str, dim: int, ratio: int, overlap: bool) -> list[tuple[str, tuple[int, ...]]]:
        width = 2 * dim if overlap else dim
        return [(prefix + "position_bias", (ratio, width)), (prefix + "kv_proj.weight", (width, h)),
                (prefix + "gate_proj.weight", (width, h)), (prefix + "kv_norm.weight", (dim,))]

    c = a + "compressor."
    if kind == "csa":
        ci, ni = m.index_head_dim, m.index_n_heads
        out += pooling(c, d, 4, True) + pooling(c + "indexer.", ci, 4, True)
        out += [(c + "indexer.q_b_proj.weight", (ni * ci, qr)), (c + "indexer.scorer.weights_proj.weight", (ni, h))]
    elif kind == "hca":
        out += pooling(c, d, int(m.compress_ratios[i]), False)
    e, im, si = m.n_routed_experts, m.moe_intermediate_size, m.moe_intermediate_size * m.n_shared_experts
    out += [("mlp.gate.weight", (e, h)), ("mlp.experts.gate_proj", (e, im, h)), ("mlp.experts.up_proj", (e, im, h)),
            ("mlp.experts.down_proj", (e, h, im))]
    if m.n_shared_experts:
        out += [("mlp.shared_experts.gate_proj.weight", (si, h)), ("mlp.shared_experts.up_proj.weight", (si, h)),
                ("mlp.shared_experts.down_proj.weight", (h, si))]
    out += [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
    mix = (2 + hc) * hc
    for name in ("attn_hc", "ffn_hc") if m.enable_hyper_connections else ():  # false: plain residual adds
        out += [(f"{name}.fn", (mix, hc * h)), (f"{name}.base", (mix,)), (f"{name}.scale", (3,))]
    if i >= m.num_hidden_layers:  # an MTP module (deepseek_v4/mtp.py)
        out += [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                ("shared_head.norm.weight", (h,))] + _v4_head_shapes(m, "hc_head.")
    return [(f"model.layers.{i}.{name}", shape) for name, shape in out]


_V4_ATTENTION_TP = re.compile(r"\.self_attn\.(q_b_proj\.weight|sinks|o_a_proj\.weight|o_b_proj\.weight)$")
"""DeepSeek-V4's attention weights tensor parallelism splits: the query heads (``q_b_proj``
rows, one ``sinks`` entry per head), the grouped output projection by whole groups
(``o_a_proj`` rows; each rank's groups read exactly its heads) and ``o_b_proj``'s input."""


def _v4_tp_split(name: str) -> tuple[str, Optional[int]]:
    """DeepSeek-V4's split of ``name``: the query heads, sinks and the grouped output
    projection split by heads / groups; the shared key/value head, the low-rank query
    projection, the compressors and the lightning indexer (its top-k reads every index head's
    score) stay whole on every rank; the rest by the common rules."""
    m = _V4_ATTENTION_TP.search(name)
    if m:
        return ("row", 1) if m.group(1) == "o_b_proj.weight" else ("column", 0)
    if ".self_attn." in name:
        return "replicated", None
    return tp_split(name)


def _v4_head_shapes(m: ModelConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """The learned collapse of the streams (none with ``enable_hc_head: false``: their mean)."""
    hc = m.hc_mult
    if not m.enable_hc_head or not m.enable_hyper_connections:
        return []
    return [(prefix + "hc_fn", (hc, hc * m.hidden_size)), (prefix + "hc_base", (hc,)), (prefix + "hc_scale", (1,))]


def _v4_specs(m: ModelConfig) -> list[ParamSpec]:
    """DeepSeek-V4: its parameters with the splits of :func:`_v4_tp_split` (the ``mla``
    attention variant: DeepSeek-V3's attention, split by DeepSeek-V3's rules)."""
    h, v = m.hidden_size, m.vocab_size
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(m.num_hidden_layers + m.num_nextn_predict_layers):
        shapes += _v4_layer_shapes(m, i)
    shapes += [("model.norm.weight", (h,))] + _v4_head_shapes(m, "model.hc_head.") + [("lm_head.weight", (v, h))]
    out = []
    for name, shape in shapes:
        style, dim = tp_split(name) if m.experimental_attention_variant == "mla" else _v4_tp_split(name)
        out.append(ParamSpec(name, tuple(shape), style, dim, is_expert(name), unit_of(name, m.num_hidden_layers)))
    return out


def param_specs(m: ModelConfig) -> list[ParamSpec]:
    """Every trainable parameter of the model ``m`` describes: the embedding, the decoder
    layers, DeepSeek-V3's MTP modules, the final norm and lm_head (absent when Qwen3 ties it
    to the embedding; DeepSeek-V3's router correction biases are buffers, not listed)."""
    h, v = m.hidden_size, m.vocab_size
    shapes = [("model.embed_tokens.weight", (v, h))]
    if m.model_type == "deepseek_v4":
        return _v4_specs(m)
    if m.model_type in QWEN3_FAMILIES:
        moe = set(moe_layer_ids(m))
        for i in range(m.num_hidden_layers):
            shapes += _qwen3_layer_shapes(m, i, i in moe)
        shapes.append(("model.norm.weight", (h,)))
        if not m.tie_word_embeddings:
            shapes.append(("lm_head.weight", (v, h)))
        return [ParamSpec(name, tuple(shape), *tp_split(name), is_expert(name), unit_of(name, m.num_hidden_layers))
                for name, shape in shapes]
    for i in range(m.num_hidden_layers + m.num_nextn_predict_layers):
        shapes += _layer_shapes(m, i)
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return [ParamSpec(name, tuple(shape), *tp_split(name), is_expert(name), unit_of(name, m.num_hidden_layers))
            for name, shape in shapes]


def units(m: ModelConfig) -> list[UnitPlan]:
    """The model's units in order, each with its parameters' names and its cell path: the
    embedding, each decoder layer, the head (final norm and lm_head: no single cell), each
    MTP module."""
    n = m.num_hidden_layers
    out = [UnitPlan("embedding", "embedding", None, [], "model.embed_tokens")]
    out += [UnitPlan(f"layers.{i}", "decoder", i, [], f"model.layers.{i}") for i in range(n)]
    out.append(UnitPlan("head", "head", None, [], None))
    out += [UnitPlan(f"mtp.{k}", "mtp", n + k, [], f"model.layers.{n + k}") for k in range(m.num_nextn_predict_layers)]
    by_name = {u.name: u for u in out}
    for p in param_specs(m):
        by_name[p.unit].params.append(p.name)
    return out


def _active(p: ParamSpec, m: ModelConfig) -> int:
    """Elements of ``p`` one token uses: ``num_experts_per_tok`` of a stacked expert weight."""
    return p.numel // p.shape[0] * m.num_experts_per_tok if p.expert else p.numel


def count_parameters(m: ModelConfig) -> tuple[int, int]:
    """(total, active per token) trainable parameters, MTP modules included (a tied head is
    the embedding, counted once)."""
    specs = param_specs(m)
    return sum(p.numel for p in specs), sum(_active(p, m) for p in specs)


def flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Training FLOPs per token, the convention of the step line's throughput: 6 x the matmul
    weights a token uses (routed experts: ``num_experts_per_tok`` of them; norms and the
    embedding lookup excluded; the head once per prediction depth, a tied head's too) + the
    attention term ``6 x heads x S x (qk_head_dim + v_head_dim)`` per layer (full S, the PaLM
    convention; Qwen3: ``qk_head_dim = v_head_dim = head_dim``)."""
    s = seq_length or m.seq_length
    matmul = sum(_active(p, m) for p in param_specs(m)
                 if p.name != "model.embed_tokens.weight" and not p.name.endswith("norm.weight"))
    if m.model_type == "deepseek_v4":
        return float(6 * (matmul - _v4_not_matmul(m)) + _v4_attention_flops(m, s))
    if m.model_type in QWEN3_FAMILIES:
        if m.tie_word_embeddings:  # the head's matmul uses the embedding matrix
            matmul += m.vocab_size * m.hidden_size
        qk = v = head_dim(m)
        n_layers = m.num_hidden_layers
    else:
        matmul += m.vocab_size * m.hidden_size * m.num_nextn_predict_layers
        n_layers = m.num_hidden_layers + m.num_nextn_predict_layers
        qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    attention = 6 * m.num_attention_heads * s * (qk + v) * n_layers
    return float(6 * matmul + attention)


def _v4_not_matmul(m: ModelConfig) -> int:
    """DeepSeek-V4 parameters that are not a token's matmul weights: sinks, position biases,
    hyper-connection biases and scales (the hyper-connection ``fn`` matrices are matmuls)."""
    return sum(p.numel for p in param_specs(m)
               if p.name.endswith(("sinks", "position_bias", ".base", ".scale", "hc_base", "hc_scale")))


def _v4_attention_flops(m: ModelConfig, s: int) -> float:
    """DeepSeek-V4's attention term per token, 6 x (scores + weighted sum) x the keys a query
    attends: each layer's sliding window (min(S, window)) plus its compressed entries (all S /
    ratio of them for heavily compressed attention, index_topk for compressed sparse); the
    lightning indexer scores every compressed entry (index heads x index_head_dim, one
    product: 2 FLOPs forward per multiply-add, its backward is not taken: no gradient flows
    through the choice)."""
    n, d = m.num_attention_heads, m.head_dim
    window = min(s, m.sliding_window)
    total = 0.0
    for kind, ratio in zip(v4_attention_kinds(m), m.compress_ratios):
        keys = window
        if kind == "hca":
            keys += s // int(ratio)
        elif kind == "csa":
            entries = s // 4
            keys += min(m.index_topk, entries)
            total += 2 * m.index_n_heads * m.index_head_dim * entries
        total += 6 * n * keys * (d + d)
    return total


__all__ = ["ParamSpec", "TP_RULES", "count_parameters", "flops_per_token", "is_expert", "param_specs", "tp_split",
           "unit_of", "units"]
