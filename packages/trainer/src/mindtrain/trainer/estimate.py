"""``mindtrain-estimate``: per-device memory and FLOPs of a config's parallel layout, before
a run (pure Python: imports mindtrain.config only, no MindSpore).

    mindtrain-estimate --config configs/pynative_ds3.yaml --world-size 2
    mindtrain-estimate --config X --world-size 512 -o parallelism.expert_parallel=64 ...

Per device, for the layout ``parallelism`` resolves to on ``--world-size`` devices, it
reports what mindtrain's engines hold (``engine.py``, mindtrain-parallel's FSDP / TP / EP /
pipeline schedule), in the order they hold it:

- **parameters** resident between steps: float32 master weights; TP splits the column /
  row / vocab-split matrices over ``tensor_parallel``; EP keeps ``E / ep`` routed experts
  per rank, sharded again over ``edp = dp x cp / ep`` when they divide; FSDP shards every
  dense weight on dim 0 over ``data_parallel_shard`` (padded) and ZeRO-1/2 also keep the
  full weight beside its shard (what the metrics' ``param_bytes`` counts);
- **gathered weights** (ZeRO-3): full weights gathered for the running unit and the root
  (embedding, head), or the whole stage under pipeline parallelism;
- **gradients** at their peak: float32, a micro-batch's full gradients of what
  ``value_and_grad`` differentiates at once, plus the accumulators (full, or the FSDP shard
  under ZeRO-2/3);
- **optimizer**: AdamW's two float32 moments of what the optimizer updates (shards);
- **activations** of one micro-batch, with the config's recompute and with none / all
  layers recomputed: the tensors the model's backward keeps, counted op by op from
  mindtrain.models' portable code path (the one mindtrain trains with on every device):
  per layer the RMSNorm intermediates, MLA projections and the per-layer weight slices
  that the attention feeds its matmuls, the attention scores and probabilities
  ``heads x S x S``, the routed experts' block dispatch (gathered tokens, gathered expert
  weights per block of 32 slots, SwiGLU intermediates), the logits; once per micro-batch
  the additive attention mask ``[B, heads, S, S]`` (float32) and the backward's largest
  transient; with pipeline parallelism the stage inputs of the micro-batches in flight.

FLOPs per step: :func:`flops_per_token` (``6 x`` the matmul weights a token uses plus the
attention term, the convention of the step line's throughput) times the global batch's
tokens, and per device (divided by the world size).

Validated against the trainer's measured per-rank bytes and peak RSS: see the package
README (section "Memory estimate").
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from mindtrain.config import (ZERO3, ConfigError, MindTrainConfig, ModelConfig, ParallelDims, UserError, module_matches,
                              num_accumulation_steps, recompute_plan, resolve_parallelism)
from mindtrain.config.pipeline import layer_counts
from mindtrain.config.schema import RecomputeConfig

PROG = "mindtrain-estimate"
GB = 2 ** 30
"""Bytes per GB as printed and as ``max_device_memory`` reads it (MindSpore: 1024^3)."""
F32 = 4
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_DEVICE_MEMORY = 64 * 2 ** 30
"""Device memory when neither --device-memory nor context.max_device_memory says: one
Ascend 910B (64 GB HBM)."""
MOE_BLOCK = 32
"""Slots per block of the portable routed-experts dispatch (the model's ``moe_block``)."""


# ------------------------------------------------------------------ the parameters
@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as the model names and shapes it, with the tensor-parallel
    split mindtrain.models' parallel plan gives it and the pipeline unit that holds it."""

    name: str
    shape: tuple[int, ...]
    tp: str = "replicated"       # column / row / vocab / replicated
    tp_dim: Optional[int] = None
    expert: bool = False         # stacked routed-expert weight [E, ...]
    unit: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _layer_params(m: ModelConfig, i: int) -> list[ParamSpec]:
    unit = f"layers.{i}" if i < m.num_hidden_layers else f"mtp.{i - m.num_hidden_layers}"
    pre = f"model.layers.{i}."
    h, n = m.hidden_size, m.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    bias = bool(m.attention_bias)
    out: list[ParamSpec] = []

    def add(name, shape, tp="replicated", dim=None, expert=False):
        out.append(ParamSpec(pre + name, tuple(shape), tp, dim, expert, unit))

    a = "self_attn."
    if m.q_lora_rank:
        add(a + "q_a_proj.weight", (m.q_lora_rank, h))
        if bias:
            add(a + "q_a_proj.bias", (m.q_lora_rank,))
        add(a + "q_a_layernorm.weight", (m.q_lora_rank,))
        add(a + "q_b_proj.weight", (n * qk, m.q_lora_rank), "column", 0)
    else:
        add(a + "q_proj.weight", (n * qk, h), "column", 0)
    add(a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h))
    if bias:
        add(a + "kv_a_proj_with_mqa.bias", (m.kv_lora_rank + m.qk_rope_head_dim,))
    add(a + "kv_a_layernorm.weight", (m.kv_lora_rank,))
    add(a + "kv_b_proj.weight", (n * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), "column", 0)
    add(a + "o_proj.weight", (h, n * m.v_head_dim), "row", 1)
    if bias:
        add(a + "o_proj.bias", (h,))
    if i < m.first_k_dense_replace:
        add("mlp.gate_proj.weight", (m.intermediate_size, h), "column", 0)
        add("mlp.up_proj.weight", (m.intermediate_size, h), "column", 0)
        add("mlp.down_proj.weight", (h, m.intermediate_size), "row", 1)
    else:
        e, im = m.n_routed_experts, m.moe_intermediate_size
        add("mlp.gate.weight", (e, h))
        add("mlp.experts.gate_proj", (e, im, h), "column", 1, True)
        add("mlp.experts.up_proj", (e, im, h), "column", 1, True)
        add("mlp.experts.down_proj", (e, h, im), "row", 2, True)
        if m.n_shared_experts:
            si = im * m.n_shared_experts
            add("mlp.shared_experts.gate_proj.weight", (si, h), "column", 0)
            add("mlp.shared_experts.up_proj.weight", (si, h), "column", 0)
            add("mlp.shared_experts.down_proj.weight", (h, si), "row", 1)
    add("input_layernorm.weight", (h,))
    add("post_attention_layernorm.weight", (h,))
    if i >= m.num_hidden_layers:
        add("enorm.weight", (h,))
        add("hnorm.weight", (h,))
        add("eh_proj.weight", (h, 2 * h))
        add("shared_head.norm.weight", (h,))
    return out


def param_table(m: ModelConfig) -> list[ParamSpec]:
    """Every trainable parameter of the DeepSeek-V3 model ``m`` describes (HF names; the
    routers' correction biases are buffers, not listed)."""
    h, v = m.hidden_size, m.vocab_size
    out = [ParamSpec("model.embed_tokens.weight", (v, h), "vocab", 0, False, "embedding")]
    for i in range(m.num_hidden_layers + m.num_nextn_predict_layers):
        out += _layer_params(m, i)
    out += [ParamSpec("model.norm.weight", (h,), unit="head"),
            ParamSpec("lm_head.weight", (v, h), "column", 0, False, "head")]
    return out


def flops_per_token(m: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Training FLOPs per token, the convention of the step line's throughput
    (``mindtrain.models.flops_per_token``): 6 x the matmul weights a token uses (routed
    experts: ``num_experts_per_tok`` of them; norms and the embedding lookup excluded; the
    head once per prediction depth) + ``6 x heads x S x (qk_head_dim + v_head_dim)`` per
    layer."""
    s = seq_length or m.seq_length
    matmul = 0.0
    for p in param_table(m):
        if p.name == "model.embed_tokens.weight" or p.name.endswith("norm.weight"):
            continue
        if p.expert:
            matmul += p.numel * m.num_experts_per_tok / m.n_routed_experts
        else:
            matmul += p.numel
    matmul += m.vocab_size * m.hidden_size * m.num_nextn_predict_layers
    n_layers = m.num_hidden_layers + m.num_nextn_predict_layers
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    attention = 6 * m.num_attention_heads * s * (qk + m.v_head_dim) * n_layers
    return float(6 * matmul + attention)


# ------------------------------------------------------------------ layout
def _layer_index(m: ModelConfig, unit: str) -> int:
    """The model layer of a decoder (``layers.N``) or MTP (``mtp.K``) unit: MTP module K is
    layer ``num_hidden_layers + K``."""
    kind, n = unit.split(".")
    return int(n) + (m.num_hidden_layers if kind == "mtp" else 0)


def _units(m: ModelConfig, dims: ParallelDims, layers_per_stage, chunks: int) -> list[list[str]]:
    """Unit names per pipeline rank (its chunks together), as the pipeline schedule
    partitions them: embedding on the first virtual stage, head and MTP on the last."""
    n = m.num_hidden_layers
    n_virtual = dims.pp * chunks
    counts = layer_counts(layers_per_stage, n, dims.pp, chunks) if dims.pp > 1 else None
    if counts is None:
        base, extra = divmod(n, n_virtual)
        counts = [base + (1 if i < extra else 0) for i in range(n_virtual)]
    virtual, start = [], 0
    for i, c in enumerate(counts):
        names = [f"layers.{j}" for j in range(start, start + c)]
        start += c
        if i == 0:
            names = ["embedding"] + names
        if i == n_virtual - 1:
            names += ["head"] + [f"mtp.{k}" for k in range(m.num_nextn_predict_layers)]
        virtual.append(names)
    return [[u for c in range(chunks) for u in virtual[c * dims.pp + r]] for r in range(dims.pp)]


def _local_numel(p: ParamSpec, dims: ParallelDims) -> int:
    """Elements of ``p`` on one rank after TP (and EP for routed experts)."""
    shape = list(p.shape)
    if dims.tp > 1 and p.tp != "replicated":
        shape[p.tp_dim] //= dims.tp
    if p.expert and dims.ep > 1:
        local = shape[0] // dims.ep
        edp = dims.dp_shard * dims.cp // dims.ep
        shape[0] = local // edp if local % edp == 0 else local
    return math.prod(shape)


def _local_rows(p: ParamSpec, dims: ParallelDims) -> tuple[int, int]:
    """(dim-0 rows, elements per row) of ``p``'s TP piece (FSDP shards dim 0)."""
    shape = list(p.shape)
    if dims.tp > 1 and p.tp != "replicated":
        shape[p.tp_dim] //= dims.tp
    return shape[0], math.prod(shape[1:])


def _shard_numel(p: ParamSpec, dims: ParallelDims) -> int:
    rows, rest = _local_rows(p, dims)
    return -(-rows // dims.dp_shard) * rest


@dataclass
class StageBytes:
    """One pipeline rank's bytes by kind (every rank of a stage holds the same)."""

    stage: int
    units: list[str]
    params: int = 0
    gathered: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    activations_none: int = 0
    activations_full: int = 0
    in_flight: int = 0
    breakdown: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.gathered + self.grads + self.optimizer + self.activations + self.in_flight


def stage_bytes(cfg: MindTrainConfig, dims: ParallelDims, stage: int, units: list[str],
                table: list[ParamSpec], accumulation: int) -> StageBytes:
    """Parameter, gathered-weight, gradient and optimizer bytes of a rank of ``stage``."""
    m = cfg.model
    strategy = cfg.parallelism.data_parallel_shard_strategy
    pipeline = dims.pp > 1 or dims.cp > 1
    mine = set(units)
    shared = {"model.embed_tokens.weight", "lm_head.weight"} if m.num_nextn_predict_layers else set()
    uses_mtp = any(u.startswith("mtp.") for u in units)
    params = [p for p in table if p.unit in mine or (pipeline and uses_mtp and p.name in shared)]
    experts = [p for p in params if p.expert and dims.ep > 1]
    dense = [p for p in params if not (p.expert and dims.ep > 1)]
    fsdp = dims.dp_shard > 1
    full = sum(_local_numel(p, dims) for p in dense)
    shards = sum(_shard_numel(p, dims) for p in dense) if fsdp else full
    expert_numel = sum(_local_numel(p, dims) for p in experts)
    out = StageBytes(stage, units)
    zero3 = fsdp and strategy == ZERO3
    out.params = F32 * ((0 if zero3 else full) + (shards if fsdp else 0) + expert_numel)
    out.optimizer = 2 * F32 * (shards + expert_numel)
    # routed experts (EP): one MoE layer's local experts are gathered over edp while they
    # run (forward, and again in their backward, which also makes their full gradients)
    edp = dims.dp_shard * dims.cp // dims.ep
    per_layer: dict[str, int] = {}
    for p in experts:
        per_layer[p.unit] = per_layer.get(p.unit, 0) + p.numel // p.shape[0] * (p.shape[0] // dims.ep) // (
            dims.tp if dims.tp > 1 and p.tp != "replicated" else 1)
    expert_live = max(per_layer.values(), default=0)
    expert_sharded = bool(experts) and (m.n_routed_experts // dims.ep) % edp == 0 and edp > 1
    units_numel: dict[str, int] = {}
    for p in dense:
        units_numel[p.unit] = units_numel.get(p.unit, 0) + _local_numel(p, dims)
    # ZeRO-3 outside a pipeline wraps each layer as a unit; in a pipeline stage everything
    # is the root (mindtrain.parallel.compose.ShardedLayout)
    has_units = zero3 and not pipeline
    if zero3:
        if has_units:
            root = sum(v for u, v in units_numel.items() if u in ("embedding", "head"))
            unit_max = max((v for u, v in units_numel.items() if u not in ("embedding", "head")), default=0)
            out.gathered = F32 * (root + unit_max)
        else:
            out.gathered = F32 * full  # the stage's weights, for the whole step
    if expert_sharded:
        out.gathered += F32 * expert_live
    # gradients: one micro-batch's full gradients of what value_and_grad differentiates at
    # once (ZeRO-3 units: the root and one unit), the accumulators kept over the step
    # (ZeRO-2/3: the shard; ZeRO-1 and more than one micro-batch: full), the experts'
    fresh = out.gathered // F32 - (expert_live if expert_sharded else 0) if has_units else full
    if fsdp:
        acc = full if strategy == "optim" else shards
    else:
        acc = full if accumulation > 1 else 0
    out.grads = F32 * (fresh + acc + expert_numel + expert_live)
    return out


# ------------------------------------------------------------------ activations
@dataclass
class Module:
    """A cell of a decoder layer (``path`` as ``set_recompute`` matches it): the bytes its own
    operations keep for backward (``own``) and its sub-cells. Recomputing it drops them all;
    its inputs are kept by its caller's operations (or the recompute wrapper)."""

    path: str
    own: int = 0
    children: list["Module"] = field(default_factory=list)

    def total(self) -> int:
        return self.own + sum(c.total() for c in self.children)

    def walk(self):
        yield self
        for c in self.children:
            yield from c.walk()


@dataclass(frozen=True)
class _Shapes:
    """Local sizes one rank's layer sees for one micro-batch."""

    b: int           # micro-batch size
    s: int           # local sequence (S / cp)
    sk: int          # keys per query row (S)
    tl: int          # tokens in the residual stream (b * s / tp under sequence parallelism)
    ta: int          # tokens inside attention / MLP regions (b * s)
    heads: int       # local heads (N / tp)
    inter: int       # dense MLP intermediate (I / tp)
    moe_inter: int   # routed expert intermediate (I_moe / tp)
    c: int           # bytes of the compute dtype (matmul operands)


def _rms(rows: int, d: int) -> int:
    """An RMSNorm's kept intermediates (the portable norm: x^2, the broadcast inverse rms,
    the broadcast weight, the normalised x; all float32)."""
    return 4 * rows * d * F32


def _attention(m: ModelConfig, z: _Shapes) -> Module:
    h, n, c = m.hidden_size, z.heads, z.c
    dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    kl, ql = m.kv_lora_rank, m.q_lora_rank
    t = z.ta
    own = 0
    if z.tl != z.ta or c != F32:
        own += t * h * c                      # the gathered (or cast) input of the projections
    q_in = ql or h
    if ql:
        own += t * ql * c                     # q_a_proj output (the q norm's input)
        own += _rms(t, ql) + t * ql * F32     # q_a_layernorm and its output
        if c != F32:
            own += t * ql * c
    own += 2 * t * n * dr * c                 # rope halves of q (times cos / sin)
    own += t * n * (dn + dr) * c              # q
    own += t * kl * c + _rms(t, kl) + t * kl * F32   # latent kv, its norm and output
    if z.sk != z.s:                           # context parallelism: the whole sequence's latent
        own += z.b * z.sk * kl * F32
    own += 2 * t * dr * c                     # rope halves of k
    own += z.b * n * z.sk * (dn + dr) * c     # k
    own += z.b * n * z.sk * dv * c            # v
    own += t * n * dv * c                     # attention output (o_proj input)
    # weight slices fed to the matmuls (q nope / rope / rotated rope, latent, k rope, kv_b)
    own += (q_in * n * (dn + 3 * dr) + h * (kl + 3 * dr) + kl * n * (dn + dv)) * c
    scores = z.b * n * z.s * z.sk
    core = Module("self_attn.core_attention", 2 * scores * F32 + (scores * c if c != F32 else 0))
    return Module("self_attn", own, [core])


def _mlp(path: str, t: int, h: int, inter: int, c: int, gathered: bool) -> Module:
    own = 4 * t * inter * c                   # gate, silu(gate), up, silu(gate) * up
    if gathered or c != F32:
        own += t * h * c
    return Module(path, own)


def _moe(m: ModelConfig, z: _Shapes, dims: ParallelDims) -> Module:
    h, c, e, k = m.hidden_size, z.c, m.n_routed_experts, m.num_experts_per_tok
    router = Module("mlp.gate", 3 * z.tl * e * F32)   # scores, normalised scores, balance terms
    if dims.ep > 1:
        # expert parallelism: the (token, choice) rows sorted, sent and received, the
        # returned outputs; the local experts recompute in their own backward
        experts = Module("mlp.experts", 4 * z.ta * k * h * c)
    else:
        pairs = z.ta * k
        slots = -(-(pairs + e * (MOE_BLOCK - 1)) // MOE_BLOCK) * MOE_BLOCK
        blocks = slots // MOE_BLOCK
        own = slots * h * c                               # tokens gathered into slots
        own += 3 * blocks * z.moe_inter * h * c           # each block's expert weights
        own += 6 * slots * z.moe_inter * c                # gate, silu, up, product, scale, weighted
        experts = Module("mlp.experts", own)
    children = [router, experts]
    if m.n_shared_experts:
        children.append(_mlp("mlp.shared_experts", z.ta, h, z.moe_inter * m.n_shared_experts, c, False))
    own = z.ta * h * c if z.ta != z.tl else 0             # tokens gathered over TP
    return Module("mlp", own, children)


def layer_module(m: ModelConfig, i: int, z: _Shapes, dims: ParallelDims) -> Module:
    """Layer ``i``'s kept tensors as a module tree (paths as the model's cells name them)."""
    h = m.hidden_size
    tl = z.tl
    children = [Module("input_layernorm", _rms(tl, h)), _attention(m, z),
                Module("post_attention_layernorm", _rms(tl, h))]
    if i < m.first_k_dense_replace:
        children.append(_mlp("mlp", z.ta, h, z.inter, z.c, z.ta != z.tl))
    else:
        children.append(_moe(m, z, dims))
    # the norm outputs (the regions' inputs) and the mid-layer residual
    own = 3 * tl * h * F32
    if i >= m.num_hidden_layers:  # MTP: embedding of the shifted tokens, both norms, their concat
        own += tl * h * F32 + 2 * (_rms(tl, h) + tl * h * F32) + 2 * tl * h * F32
    return Module("", own, children)


def _layer_input(m: ModelConfig, i: int, z: _Shapes) -> int:
    n = z.tl * m.hidden_size * F32
    return 2 * n if i >= m.num_hidden_layers else n


def _layer_kept(mod: Module, m: ModelConfig, i: int, z: _Shapes, plan_full: set, select: dict,
                core_in_blocks: bool = False) -> tuple[int, int]:
    """(bytes kept from forward to backward, bytes rebuilt while its backward runs) of layer
    ``i``. ``core_in_blocks``: a rebuilt attention core keeps only its inputs (each of its
    blocks rebuilds itself in its own backward)."""
    inp = _layer_input(m, i, z)
    core = next(sub.total() for sub in mod.walk() if sub.path == "self_attn.core_attention") \
        if core_in_blocks else 0
    if i in plan_full:
        return inp, mod.total() - core
    kept = inp
    rebuilt = 0
    covered: list[str] = []
    for sub in mod.walk():
        if not sub.path:
            continue
        if any(sub.path.startswith(p + ".") for p in covered):
            continue
        hit = any(i in ids and module_matches(pat, sub.path)
                  for pat, ids in select.items())
        if hit:
            covered.append(sub.path)
            holds_core = "self_attn.core_attention" == sub.path or "self_attn.core_attention".startswith(sub.path + ".")
            rebuilt = max(rebuilt, sub.total() - (core if holds_core else 0))
    for sub in mod.walk():
        if sub.path and not any(sub.path == p or sub.path.startswith(p + ".") for p in covered):
            kept += sub.own
    kept += mod.own
    return kept, rebuilt


# mindtrain-models' CoreAttention.row_block_elements: a layer whose attention core is recomputed
# (eager, or compiled with more scores per sequence than a block) runs the core (its first pass
# and its backward) in blocks of rows of one sequence and head, each with at most this many
# score elements (when the whole scores hold more)
ROW_BLOCK_ELEMENTS = 1 << 22


def _core_recomputed(i: int, full: set, select: dict) -> bool:
    """Layer ``i``'s attention core is recomputed: the whole layer, or a selected module
    that is the core or holds it."""
    return i in full or any(i in ids and (module_matches(pat, "self_attn.core_attention") or
                                          module_matches(pat, "self_attn"))
                            for pat, ids in select.items())


def activation_bytes(cfg: MindTrainConfig, dims: ParallelDims, units: list[str], compute_bytes: int,
                     recompute: Optional[RecomputeConfig] = None, breakdown: Optional[dict] = None) -> int:
    """Peak bytes of one micro-batch's activations on a rank holding ``units``, with
    ``recompute`` (default: the config's). ``breakdown`` (a dict) receives the bytes by kind
    without recompute. Layers whose attention core is recomputed rebuild its scores one
    block at a time (:data:`ROW_BLOCK_ELEMENTS`): eager layers, and compiled ones whose
    sequence's scores exceed a block."""
    m = cfg.model
    b = cfg.training.local_batch_size
    s = m.seq_length // dims.cp
    tokens = b * s
    z = _Shapes(b=b, s=s, sk=m.seq_length, tl=tokens // dims.tp, ta=tokens, heads=m.num_attention_heads // dims.tp,
                inter=m.intermediate_size // dims.tp, moe_inter=m.moe_intermediate_size // dims.tp, c=compute_bytes)
    n_layers = m.num_hidden_layers + m.num_nextn_predict_layers
    plan = recompute_plan(recompute if recompute is not None else cfg.recompute, n_layers)
    full, select = set(plan.full), plan.select
    cores = (full, select)  # what decides whether a layer's core runs in blocks
    layer_ids = [_layer_index(m, u) for u in units if u.startswith("layers.")]
    layer_ids += [_layer_index(m, u) for u in units if u.startswith("mtp.")]
    kept = rebuilt = 0
    kinds = {"attention scores and probabilities": 0, "routed-expert dispatch": 0, "attention mask": 0,
             "logits": 0, "other": 0, "backward transient": 0}
    scores = b * z.heads * s * m.seq_length
    eager = not cfg.compile.enable  # every layout compiles with it (parallel's compiled_regions)
    # compiled layers too, when one sequence's scores exceed a block: the model compiles such
    # a layer around its core (mindtrain-models' DeepseekV3ForCausalLM._blocked_cores)
    in_blocks = scores > ROW_BLOCK_ELEMENTS and (eager or m.num_attention_heads * m.seq_length ** 2 > ROW_BLOCK_ELEMENTS)
    block = min(s, max(1, ROW_BLOCK_ELEMENTS // m.seq_length)) * m.seq_length  # one block's scores
    largest_scores = 0  # the scores one attention backward holds at once
    for i in layer_ids:
        mod = layer_module(m, i, z, dims)
        blocked = in_blocks and _core_recomputed(i, *cores)
        k, r = _layer_kept(mod, m, i, z, full, select, blocked)
        paths = {sub.path: sub.total() for sub in mod.walk()}
        largest_scores = max(largest_scores, block if blocked else scores)
        kept += k
        rebuilt = max(rebuilt, r)
        kinds["attention scores and probabilities"] += paths["self_attn.core_attention"]
        kinds["routed-expert dispatch"] += paths.get("mlp.experts", 0)
        kinds["other"] += mod.total() + _layer_input(m, i, z) - paths["self_attn.core_attention"] \
            - paths.get("mlp.experts", 0)
    h, v = m.hidden_size, m.vocab_size // dims.tp
    # the attention backward's largest moment: the probabilities' gradient, the softmax
    # backward's dout * out, its broadcast row sums, out * rows and the result
    transient = 5 * largest_scores * F32
    if "embedding" in units:
        kept += z.tl * h * F32
    if "head" in units:
        depths = 1 + m.num_nextn_predict_layers
        # final norm (its input and output; gathered over TP) and the logits, per depth
        kept += depths * (2 * z.tl * h * F32 + (tokens * h * F32 if dims.tp > 1 else 0) + tokens * v * F32)
        # the cross-entropy's backward: the broadcast output gradient, the softmax, their
        # product and the label scatter's result
        transient = max(transient, 4 * tokens * v * F32)
    mask = b * m.num_attention_heads * s * m.seq_length * F32 if layer_ids else 0
    if breakdown is not None:
        kinds["attention mask"] = mask
        kinds["backward transient"] = transient
        if "head" in units:
            kinds["logits"] = (1 + m.num_nextn_predict_layers) * tokens * v * F32
        kinds["other"] += kept - sum(_layer_kept(layer_module(m, i, z, dims), m, i, z, full, select)[0]
                                     for i in layer_ids) - kinds["logits"]
        breakdown.update({k: v for k, v in kinds.items() if v})
    return kept + rebuilt + transient + mask


# ------------------------------------------------------------------ the estimate
@dataclass
class Estimate:
    dims: ParallelDims
    strategy: str
    accumulation: int
    compute_dtype: str
    device: str
    stages: list[StageBytes]
    flops_per_token: float
    flops_per_step: float
    device_memory: Optional[int]
    recompute_mode: str
    memory_source: str = "given"

    compile_enabled: bool = True

    @property
    def compiled(self) -> bool:
        """The layout runs compiled graphs (whole layers, or the pieces between TP/EP/CP's
        collectives): every layout does with ``compile.enable``."""
        return self.compile_enabled

    @property
    def worst(self) -> StageBytes:
        return max(self.stages, key=lambda s: s.total)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_memory is None else self.worst.total <= self.device_memory


def effective_dtype(requested: str, device: str) -> str:
    """The compute dtype a model runs with on ``device`` (bfloat16 has no CPU matmul in
    MindSpore 2.10: float32 there, as ``mindtrain.models.effective_compute_dtype``)."""
    if requested not in DTYPE_BYTES:
        raise ConfigError("model.compute_dtype", f"must be one of {', '.join(DTYPE_BYTES)}, got {requested!r}")
    return "float32" if device.upper() == "CPU" and requested == "bfloat16" else requested


def parse_bytes(text, path: str = "context.max_device_memory") -> int:
    """``"58GB"`` / ``"512MB"`` / ``"1.5TB"`` / a plain number of bytes -> bytes (GB = 1024^3,
    as MindSpore reads max_device_memory)."""
    units = {"": 1, "B": 1, "KB": 2 ** 10, "MB": 2 ** 20, "GB": 2 ** 30, "TB": 2 ** 40}
    mt = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B?)\s*", str(text), re.IGNORECASE)
    if not mt or float(mt.group(1)) <= 0:
        raise ConfigError(path, f"{text!r} is not a memory size; write it like \"58GB\" or \"512MB\"")
    return int(float(mt.group(1)) * units[mt.group(2).upper()])


def estimate(cfg: MindTrainConfig, world_size: int, device: str = "Ascend",
             device_memory: Optional[int] = None) -> Estimate:
    """The per-device estimate of ``cfg`` on ``world_size`` devices."""
    dims = resolve_parallelism(cfg.parallelism, world_size)
    accum = num_accumulation_steps(cfg, dims)
    m = cfg.model
    dtype = effective_dtype(m.compute_dtype, device)
    c = DTYPE_BYTES[dtype]
    table = param_table(m)
    p = cfg.parallelism
    chunks = p.pipeline_parallel_interleave_num if dims.pp > 1 else 1
    parts = _units(m, dims, p.pipeline_parallel_layers_per_stage, chunks)
    stages = []
    for r, units in enumerate(parts):
        st = stage_bytes(cfg, dims, r, units, table, accum)
        st.activations = activation_bytes(cfg, dims, units, c)
        st.activations_none = activation_bytes(cfg, dims, units, c, RecomputeConfig(mode="None"), st.breakdown)
        st.activations_full = activation_bytes(cfg, dims, units, c, RecomputeConfig(mode="full"))
        if dims.pp > 1:
            # 1F1B: stage r has up to pp - r micro-batches between forward and backward;
            # each keeps its stage input and output (the stage recomputes its forward)
            in_flight = min(accum, dims.pp * chunks - r)
            act = cfg.training.local_batch_size * (m.seq_length // dims.cp // dims.tp) * m.hidden_size * F32
            st.in_flight = 2 * in_flight * act
        stages.append(st)
    fpt = flops_per_token(m)
    step = fpt * cfg.training.global_batch_size * m.seq_length
    return Estimate(dims=dims, strategy=p.data_parallel_shard_strategy, accumulation=accum, compute_dtype=dtype,
                    device=device, stages=stages, flops_per_token=fpt, flops_per_step=step,
                    device_memory=device_memory, recompute_mode=str(cfg.recompute.mode),
                    compile_enabled=bool(cfg.compile.enable))


# ------------------------------------------------------------------ report
def _gb(n: float, unit: int = GB) -> str:
    return f"{n / unit:,.2f}"


def report(est: Estimate, config_name: str) -> list[str]:
    d = est.dims
    strategy = {"optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}[est.strategy]
    lines = [f"{PROG}: {config_name} on {d.world_size} device(s) ({est.device}, compute {est.compute_dtype})",
             f"layout: dp_shard={d.dp_shard} ({strategy if d.dp_shard > 1 else 'no sharding'}) tp={d.tp} "
             f"cp={d.cp} pp={d.pp} ep={d.ep} edp={d.dp_shard * d.cp // d.ep}; "
             f"{est.accumulation} micro-batch(es) per step; recompute {est.recompute_mode}"]
    worst = est.worst
    if d.pp <= 4:
        cols = list(est.stages)
    else:  # the first, the worst and the last stage
        cols = [est.stages[i] for i in sorted({0, worst.stage, d.pp - 1})]
    unit, uname = (GB, "GB") if worst.total >= GB else (2 ** 20, "MB")
    head = f"per device ({uname})".ljust(34) + "".join(
        ((f"stage {s.stage}" + (" *" if s is worst else "")) if d.pp > 1 else "each rank").rjust(14) for s in cols)
    lines.append(head)
    rows = [("parameters (fp32, resident)", "params"), ("gathered weights (transient)", "gathered"),
            ("gradients (fp32, peak)", "grads"), ("optimizer (AdamW, 2 x fp32)", "optimizer"),
            (f"activations / micro-batch ({est.recompute_mode})", "activations"),
            ("pipeline micro-batches in flight", "in_flight"), ("total", "total")]
    for label, attr in rows:
        if attr == "in_flight" and d.pp == 1:
            continue
        lines.append(label.ljust(34) + "".join(_gb(getattr(s, attr), unit).rjust(14) for s in cols))
    lines.append("activations, no recompute".ljust(34) + "".join(_gb(s.activations_none, unit).rjust(14) for s in cols))
    lines.append("activations, full recompute".ljust(34) + "".join(_gb(s.activations_full, unit).rjust(14) for s in cols))
    kinds = ", ".join(f"{k} {_gb(v, unit)}" for k, v in worst.breakdown.items())
    lines.append(f"activations without recompute ({uname}{', stage %d' % worst.stage if d.pp > 1 else ''}): {kinds}")
    lines.append(f"FLOPs per step: {est.flops_per_step:.4g} ({est.flops_per_token:.4g} per token x "
                 f"{est.flops_per_step / est.flops_per_token:,.0f} tokens); per device "
                 f"{est.flops_per_step / d.world_size:.4g}")
    if est.compiled:
        lines.append("note: this layout runs compiled (ms.jit) layers or regions; on CPU their graph workspaces "
                     "took up to 3x the activation figure above (package README, Memory estimate)")
    if est.device_memory is None:
        lines.append("fit: no device memory given (set context.max_device_memory or pass --device-memory)")
    else:
        lines.append(f"device memory: {_gb(est.device_memory)} GB ({est.memory_source})")
        cap = est.device_memory
        diff = worst.total - cap
        where = f" (stage {worst.stage})" if d.pp > 1 else ""
        if diff > 0:
            lines.append(f"does NOT fit: needs {_gb(worst.total)} GB per device{where}, {_gb(cap)} GB available: "
                         f"{_gb(diff)} GB over ({worst.total / cap:.1f}x)")
        else:
            lines.append(f"fits: needs {_gb(worst.total)} GB per device{where} of {_gb(cap)} GB "
                         f"({_gb(-diff)} GB spare)")
    return lines


# ------------------------------------------------------------------ command line
class UsageError(UserError):
    """A command-line mistake."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message} (usage: {PROG} --config CONFIG.yaml --world-size N)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Per-device memory (parameters, gradients, optimizer, activations) and "
                                       "FLOPs of a config's parallel layout, and whether it fits the device.")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--world-size", type=int, required=True, help="number of devices (msrun --worker_num)")
    p.add_argument("--device-memory", help="memory per device, e.g. 64GB (default: context.max_device_memory)")
    p.add_argument("--device", choices=("Ascend", "CPU"), help="device the compute dtype is resolved for "
                                                               "(default: context.device_target, else Ascend)")
    p.add_argument("--override", "-o", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="replace one config value (YAML), as run_mindformer.py --override; repeatable")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mindtrain.config import load_config

    try:
        args = build_parser().parse_args(argv)
        if args.world_size < 1:
            raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
        cfg = load_config(args.config, args.override, world_size=args.world_size)
        device = args.device or cfg.context.device_target or "Ascend"
        if args.device_memory is not None:
            memory = parse_bytes(args.device_memory, "--device-memory")
        elif cfg.context.max_device_memory:
            memory = parse_bytes(cfg.context.max_device_memory)
        else:
            memory = DEFAULT_DEVICE_MEMORY
        est = estimate(cfg, args.world_size, device, memory)
        est.memory_source = ("--device-memory" if args.device_memory is not None else
                             "context.max_device_memory" if cfg.context.max_device_memory else
                             "assumed: context.max_device_memory is unset; a 64 GB Ascend 910B device")
    except UserError as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return 2
    for line in report(est, args.config):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
