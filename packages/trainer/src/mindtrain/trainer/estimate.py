"""``mindtrain-estimate``: per-device memory and FLOPs of a config's parallel layout, before
a run (pure Python: imports mindtrain.config only, no MindSpore).

    mindtrain-estimate --config configs/pynative_ds3.yaml --world-size 2
    mindtrain-estimate --config X --world-size 512 -o parallelism.expert_parallel=64 ...

Per device, for the layout ``parallelism`` resolves to on ``--world-size`` devices, it
reports what mindtrain's engines hold (mindtrain-parallel's FSDP / TP / EP / pipeline
schedule, the trainer's step), sized from the model's own parameter plan
(:mod:`mindtrain.config.model_plan`), stage partition
(:func:`mindtrain.config.pipeline.partition_units`) and row-block rule
(:func:`mindtrain.config.recompute.core_in_row_blocks`):

- **runtime** (CPU, where the device's memory is the host's): the process before its model,
  MindSpore and mindtrain imported (:data:`RUNTIME_BYTES`);
- **parameters** resident between steps: float32 master weights; TP splits the column /
  row / vocab-split matrices over ``tensor_parallel``; EP keeps ``E / ep`` routed experts
  per rank, sharded again over ``edp = dp x cp / ep`` when they divide; FSDP shards every
  dense weight on dim 0 over ``data_parallel_shard`` (padded) and ZeRO-1/2 also keep the
  full weight beside its shard (what the metrics' ``param_bytes`` counts);
- **gathered weights** (ZeRO-3): full weights of the root (embedding, head) and of the
  running bucket of units (FSDP gathers consecutive units up to ``ZERO3_BUCKET_BYTES`` of
  full weights by one collective: every layer of a small model at once), or every weight
  with ``reshard_after_forward_policy: never`` (kept from the forward to the end of the
  backward) and for the whole stage under pipeline parallelism; on a device that
  dispatches asynchronously (ZeRO-3 units replay their forward there) with compiled layers
  also the last unit's weights that its kind's forward and backward graphs keep as their
  last inputs (``graph held``; on CPU the units release those weights' storage in place);
- **gradients** at the step's peak moment (:class:`StageBytes`): the backward (a
  micro-batch's fresh gradients beside the accumulators; from the second micro-batch on the
  sum ``a + g`` makes new accumulators while the old ones live) or the optimizer step (the
  clipped copy ``g * coef`` beside the gradients); an eager backward makes its fresh
  gradients in the memory its activations free;
- **optimizer**: AdamW's two float32 moments (Muon's one buffer per matrix) of what the
  optimizer updates (shards): with ``lora_config`` only the adapters (``lora_a`` / ``lora_b``
  of the layers it selects, :mod:`mindtrain.trainer.lora_rules`), which also count among the
  parameters; the gradients are every parameter's, as the run differentiates the frozen
  base weights too (their gradients are made, then left unused);
- **activations** of one micro-batch, with the config's recompute and with none / all
  layers recomputed: the tensors the model's backward keeps, counted op by op from
  mindtrain.models' portable code path (the one mindtrain trains with on every device):
  per layer the RMSNorm intermediates, MLA projections and the per-layer weight slices
  that the attention feeds its matmuls, the attention scores and probabilities
  ``heads x S x S``, the routed experts' block dispatch (gathered tokens, gathered expert
  weights per block of 32 slots, SwiGLU intermediates), the logits; once per micro-batch
  the additive attention mask ``[B, heads, S, S]`` (float32; with compiled layers on the
  causal mask also its row blocks, :func:`mindtrain.config.plan.causal_block_elements` per
  plane) and the backward's largest transient; with pipeline parallelism the stage inputs of the micro-batches in flight;
  ZeRO-3's units (outside a pipeline) on a device that dispatches asynchronously run each
  layer's forward again in its backward, so there a layer keeps only its input, as under
  full recompute (on CPU they keep their activations: no forward replayed);
- **grad norm** (CPU): the float64 copy of the largest gradient piece the optimizer updates
  and its square, on the host;
- **save peak** (CPU): MindSpore's memory pool keeps what training reached, so a save holds
  the training peak, less the host (numpy) memory freed back to the system (the grad norm's
  copies; ZeRO-3's gathered weights over the shared-memory transport), plus its own buffer:
  the largest piece it writes (each rank writes its pieces one at a time), or with
  ``checkpoint.async_save`` host copies of all of them.

FLOPs per step: :func:`mindtrain.config.model_plan.flops_per_token` (the step line's
convention) times the global batch's tokens, and per device (divided by the world size).

Validated against the trainer's measured per-rank bytes and peak RSS: see the package
README (section "Memory estimate") and ``benchmarks/bench_scale.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from mindtrain.config import (ZERO3, ConfigError, MindTrainConfig, ModelConfig, ParallelDims, UserError, module_matches,
                              num_accumulation_steps, recompute_plan, resolve_parallelism)
from mindtrain.config import recompute as recompute_rules
from mindtrain.config import families
from mindtrain.config.model_plan import ParamSpec, flops_per_token, param_specs
from mindtrain.config.model_plan import units as model_units
from mindtrain.config.pipeline import partition_units
from mindtrain.config.fsdp_policy import reshard_after_forward
from mindtrain.config.plan import (MOE_BLOCK, ZERO3_BUCKET_BYTES, ZERO3_UNIT_KINDS, causal_block_elements, causal_block_rows,
                                   dispatches_synchronously)
from mindtrain.config.schema import RecomputeConfig

PROG = "mindtrain-estimate"
GB = 2 ** 30
"""Bytes per GB as printed and as ``max_device_memory`` reads it (MindSpore: 1024^3)."""
F32 = 4
ADAPTERS = (".lora_a", ".lora_b")
"""LoRA's adapters (``lora_config``): with them the optimizer holds only these."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_DEVICE_MEMORY = 64 * 2 ** 30
"""Device memory when neither --device-memory nor context.max_device_memory says: one
Ascend 910B (64 GB HBM)."""


# ------------------------------------------------------------------ layout
def _layer_index(m: ModelConfig, unit: str) -> int:
    """The model layer of a decoder (``layers.N``) or MTP (``mtp.K``) unit: MTP module K is
    layer ``num_hidden_layers + K``."""
    kind, n = unit.split(".")
    return int(n) + (m.num_hidden_layers if kind == "mtp" else 0)


def rank_units(m: ModelConfig, dims: ParallelDims, layers_per_stage, chunks: int) -> list[list[str]]:
    """Unit names per pipeline rank (its chunks together), as the pipeline schedule
    partitions them (:func:`mindtrain.config.pipeline.partition_units`)."""
    if dims.pp == 1:
        return [[u.name for u in model_units(m)]]
    virtual = partition_units(model_units(m), dims.pp, layers_per_stage, chunks)
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
    """FSDP's dim-0 shard of ``p``'s TP piece: over the HSDP shard group for dense weights
    (dense_fsdp_shard_size), over all of dp_shard for routed experts."""
    rows, rest = _local_rows(p, dims)
    return -(-rows // (dims.dp_shard if p.expert else dims.dense_shard_size)) * rest


RUNTIME_BYTES = {"CPU": 429_000_000}
"""Host memory of a rank before its model, by device: on CPU the process after importing
MindSpore 2.10 and mindtrain (peak RSS 0.39-0.40 GB measured, one process or an msrun
worker). On Ascend the device's memory holds no such share (the host's is not counted)."""


@dataclass
class StageBytes:
    """One pipeline rank's bytes by kind (every rank of a stage holds the same).

    ``grads`` is the gradient memory at its peak moment of the step, beyond what the
    activations hold: the backward (the micro-batch's fresh gradients beside the
    accumulators; from the second micro-batch on, the sum ``a + g`` makes new accumulators
    while the old ones live) or the optimizer step (the clipped copy ``g * coef`` of the
    gradients it is given, beside them). An eager backward frees each operation's kept
    tensors as it makes its gradients, so the fresh gradients take the activations' memory
    (``fresh_in_activations``); a compiled layer's gradients do not (measured on CPU).
    """

    stage: int
    units: list[str]
    runtime: int = 0
    params: int = 0
    gathered: int = 0
    grads_backward: int = 0
    grads_step: int = 0
    grads_fresh: int = 0
    fresh_in_activations: bool = False
    optimizer: int = 0
    activations: int = 0
    activations_none: int = 0
    activations_full: int = 0
    in_flight: int = 0
    host_transient: int = 0
    gathered_on_host: bool = False
    graph_held: int = 0
    """Compiled ZeRO-3 units: the last unit's gathered weights, which the forward graph and
    the backward graph of its kind each keep as their last call's inputs until their next
    call (MindSpore 2.10 keeps a compiled graph's inputs; measured on CPU)."""
    units_replay: bool = False
    """ZeRO-3 units outside a pipeline: each layer runs its forward again in its backward,
    so a layer keeps only its input from forward to backward (as under full recompute)."""
    save_buffer: int = 0
    breakdown: dict = field(default_factory=dict)

    @property
    def grads(self) -> int:
        shared = min(self.grads_fresh, self.activations) if self.fresh_in_activations else 0
        return max(self.grads_backward, self.grads_step) - shared

    @property
    def total(self) -> int:
        """The training peak."""
        return (self.runtime + self.params + self.gathered + self.grads + self.optimizer + self.activations
                + self.in_flight + self.host_transient + self.graph_held)

    @property
    def save_peak(self) -> int:
        """The peak during a save, right after a step: what training reached, which
        MindSpore's memory pool keeps, less the host (numpy) memory the system got back (the
        gradient norm's copies, and ZeRO-3's gathered weights where the gather runs on the
        host), plus the save's own buffer."""
        returned = self.host_transient + (self.gathered if self.gathered_on_host else 0)
        return self.total - returned + self.save_buffer


def stage_bytes(cfg: MindTrainConfig, dims: ParallelDims, stage: int, units: list[str],
                table: list[ParamSpec], accumulation: int) -> StageBytes:
    """Parameter, gathered-weight, gradient, optimizer and save-buffer bytes of a rank of
    ``stage``."""
    m = cfg.model
    strategy = cfg.parallelism.data_parallel_shard_strategy
    pipeline = dims.pp > 1 or dims.cp > 1
    mine = set(units)
    shared = {"model.embed_tokens.weight", "lm_head.weight"} if m.num_nextn_predict_layers else set()
    uses_mtp = any(u.startswith("mtp.") for u in units)
    params = [p for p in table if p.unit in mine or (pipeline and uses_mtp and p.name in shared)]
    if cfg.parallelism.expert_tensor_parallel == 1:  # routed experts whole on every TP rank
        params = [dataclasses.replace(p, tp="replicated", tp_dim=None) if p.expert else p for p in params]
    experts = [p for p in params if p.expert and dims.ep > 1]
    dense = [p for p in params if not (p.expert and dims.ep > 1)]
    fsdp = dims.dp_shard > 1
    full = sum(_local_numel(p, dims) for p in dense)
    shards = sum(_shard_numel(p, dims) for p in dense) if fsdp else full
    expert_numel = sum(_local_numel(p, dims) for p in experts)
    out = StageBytes(stage, units)
    zero3 = fsdp and strategy == ZERO3
    out.params = F32 * ((0 if zero3 else full) + (shards if fsdp else 0) + expert_numel)
    # what the optimizer updates (and a save writes moments of): every parameter, or with
    # lora_config only the adapters (mindtrain.trainer.lora.AdapterOptimizer)
    trained = [p for p in params if p.name.endswith(ADAPTERS)] if cfg.lora_config is not None else params
    held = [_shard_numel(p, dims) if fsdp and not (p.expert and dims.ep > 1) else _local_numel(p, dims)
            for p in trained]
    out.optimizer = 2 * F32 * sum(held)
    muon_full = 0  # Muon: one buffer per matrix (AdamW's two for the rest); the update's gather
    if cfg.optimizer.type == "Muon":
        from mindtrain.trainer.muon_rules import muon_matrix, uses_muon

        # the optimizer's own rule, MindFormers' names from the same (numpy-free) map
        muon = [uses_muon(p.name, p.shape, cfg.optimizer.adamw_include, cfg.model) for p in trained]
        out.optimizer = F32 * sum(n * (1 if u else 2) for n, u in zip(held, muon))
        if any(u and h != p.numel for p, h, u in zip(trained, held, muon)):
            # a split Muon matrix: the update gathers whole matrices on the host a batch at a
            # time (a LoRA-fused layer's lora_b parts together), then holds their whole
            # Newton-Schulz updates (mindtrain.trainer.muon)
            from mindtrain.trainer.muon_rules import GATHER_BYTES

            groups: dict[str, int] = {}
            for p, u in zip(trained, muon):
                if u:
                    key = muon_matrix(p.name, cfg.model)
                    groups[key] = groups.get(key, 0) + F32 * p.numel
            sizes = list(groups.values())
            muon_full = 2 * min(sum(sizes), max(GATHER_BYTES, max(sizes)))
    # routed experts (EP): one MoE layer's local experts are gathered over edp while they
    # run (forward, and again in their backward, which also makes their full gradients)
    edp = dims.dp_shard * dims.cp // dims.ep
    per_layer: dict[str, int] = {}
    for p in experts:
        per_layer[p.unit] = per_layer.get(p.unit, 0) + p.numel // p.shape[0] * (p.shape[0] // dims.ep) // (
            dims.tp if dims.tp > 1 and p.tp != "replicated" else 1)
    expert_live = max(per_layer.values(), default=0)
    expert_sharded = bool(experts) and (m.n_routed_experts // dims.ep) % edp == 0 and edp > 1
    kinds = {u.name: u.kind for u in model_units(m)}
    units_numel: dict[str, int] = {}
    for p in dense:
        units_numel[p.unit] = units_numel.get(p.unit, 0) + _local_numel(p, dims)
    # ZeRO-3 outside a pipeline gathers the ZERO3_UNIT_KINDS units a bucket at a time
    # (consecutive units up to ZERO3_BUCKET_BYTES of full weights, gathered by one collective at
    # the first one's forward and again at the last one's backward); in a pipeline stage
    # everything is the root (mindtrain.parallel.share.ModelShare); without reshard after
    # forward (reshard_after_forward_policy never) every unit stays gathered from its forward
    # to the end of the backward, which differentiates them all at once, replaying nothing
    has_units = zero3 and not pipeline
    reshard = reshard_after_forward(cfg.parallelism.reshard_after_forward_policy, strategy, dims.pp > 1)[0]
    if zero3:
        if has_units and reshard:
            root = sum(v for u, v in units_numel.items() if kinds[u] not in ZERO3_UNIT_KINDS)
            unit_sizes = [units_numel[u] for u in units if kinds[u] in ZERO3_UNIT_KINDS and u in units_numel]
            unit_max = max(unit_sizes, default=0)
            out.gathered = F32 * (root + max(_bucket_sums(unit_sizes, ZERO3_BUCKET_BYTES // F32), default=0))
            out.units_replay = True
            if cfg.compile.enable:
                out.graph_held = 2 * F32 * unit_max
        else:
            out.gathered = F32 * full  # the stage's weights, for the whole step
    has_units = has_units and reshard
    if expert_sharded:
        out.gathered += F32 * expert_live
    # gradients (float32). fresh: one micro-batch's gradients of what value_and_grad
    # differentiates at once (ZeRO-3 units: the root and one unit); accumulators: ZeRO-2/3
    # keep this rank's shards (reduce-scattered as each backward ends), ZeRO-1 and no
    # sharding the full gradients; the optimizer is given the shards (ZeRO-1/2/3) or the
    # full gradients, and clipping (training.max_norm > 0) copies them
    fresh = out.gathered // F32 - (expert_live if expert_sharded else 0) if has_units else full
    acc = shards if fsdp and strategy != "optim" else full
    given = shards if fsdp else full
    if accumulation > 1:  # acc_new = acc_old + g: both accumulators and the fresh gradients
        backward = fresh + 2 * acc
    else:  # the first micro-batch's gradients are the accumulators (ZeRO-2/3: plus their shards)
        backward = fresh + (acc if fsdp and strategy != "optim" else 0)
    clip = cfg.training.max_norm > 0
    out.grads_backward = F32 * (backward + expert_numel + expert_live)
    out.grads_step = F32 * (given + expert_numel) * (2 if clip else 1)
    out.grads_fresh = F32 * fresh
    out.fresh_in_activations = not cfg.compile.enable and not has_units
    # the gradient norm, on the host in float64: each piece's float64 copy and its square
    # (numpy's memory, beside MindSpore's pool; it counts where the device is the host)
    # (of what the optimizer updates: with LoRA the adapters' norm)
    given_pieces = [_shard_numel(p, dims) if fsdp and not (p.expert and dims.ep > 1) else _local_numel(p, dims)
                    for p in params]
    out.host_transient = max(4 * F32 * max(held, default=0), muon_full)
    # the save: each rank writes its own pieces, each made when its turn comes (the largest
    # is the buffer; in the mindformers layout two pieces of one fused tensor make one);
    # checkpoint.async_save first copies every piece this rank writes to the host
    ck = cfg.checkpoint
    if ck.enable_save:
        boxes = given_pieces  # the layout's pieces are the checkpoint's
        moments = 0 if ck.no_save_optim else 2 * sum(held)  # AdamW's two moments of what trains
        if ck.async_save:
            out.save_buffer = F32 * (sum(boxes) + moments)
        else:
            out.save_buffer = F32 * max(boxes, default=0) * (2 if ck.layout == "mindformers" else 1)
    return out


def _bucket_sums(sizes: Sequence[int], cap: int) -> list[int]:
    """The sums of consecutive ``sizes`` grouped as mindtrain-parallel's FSDP buckets them:
    each group sums to at most ``cap`` (or is one item larger than it)."""
    out: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if i and total + n > cap:
            out.append(total)
            total = 0
        total += n
    if sizes:
        out.append(total)
    return out


def with_adapters(table: list[ParamSpec], cfg: MindTrainConfig) -> list[ParamSpec]:
    """The parameter plan with ``lora_config``'s adapters (:mod:`mindtrain.trainer.lora_rules`)
    after their weights, in their weights' units; under TP a column-split weight's ``lora_b``
    splits its rows, a row-split weight's ``lora_a`` its columns, the other factor is whole
    (mindtrain.models' parallel plan, as MindFormers lays them out)."""
    from mindtrain.trainer.lora_rules import adapter_shapes

    made: dict[str, list[ParamSpec]] = {}
    base = {p.name: p for p in table}
    for name, weight, shape in adapter_shapes(table, cfg):
        w = base[weight]
        tp, tp_dim = "replicated", None
        if w.tp in ("column", "vocab") and w.tp_dim == 0 and name.endswith(".lora_b"):
            tp, tp_dim = "column", 0
        elif w.tp == "row" and w.tp_dim == 1 and name.endswith(".lora_a"):
            tp, tp_dim = "row", 1
        made.setdefault(weight, []).append(ParamSpec(name, shape, tp, tp_dim, False, w.unit))
    return [q for p in table for q in [p] + made.get(p.name, [])]


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


def _gqa_attention(m: ModelConfig, z: _Shapes, dims: ParallelDims) -> Module:
    """Qwen3's grouped-query attention (``mindtrain.models.qwen3.attention``): q/k/v
    projections, per-head RMSNorm on q and k, rope (a rotate-half matmul and two products),
    the heads transposed, the core over ``num_key_value_heads`` groups, the output projection."""
    h, n, c, t = m.hidden_size, z.heads, z.c, z.ta
    kv = max(m.num_key_value_heads // dims.tp, 1)
    d = families.head_dim(m)
    own = t * h * c if (z.tl != z.ta or c != F32) else 0   # the gathered (or cast) input
    own += t * (n + 2 * kv) * d * c                         # q, k, v
    if m.qk_layernorm:
        own += _rms(t * n, d) + _rms(t * kv, d)             # q_norm, k_norm (float32)
    else:
        own += t * (n + kv) * d * F32                       # q scaled, k (float32), no norms
    own += 4 * t * (n + kv) * d * F32                       # rotated, x cos, rotated sin, roped
    own += t * (n + 2 * kv) * d * c                         # transposed heads (the core's inputs)
    if z.sk != z.s:                                         # context parallelism: the whole sequence's k, v
        own += z.b * z.sk * 2 * kv * d * c
    own += t * n * d * c                                    # attention output (o_proj input)
    if c != F32:                                            # weights cast for the matmuls
        own += (h * (n + 2 * kv) * d + n * d * h) * c
    scores = z.b * n * z.s * z.sk
    core = Module("self_attn.core_attention", 2 * scores * F32 + (scores * c if c != F32 else 0))
    return Module("self_attn", own, [core])


def _v4_attention(m: ModelConfig, i: int, z: _Shapes) -> Module:
    """DeepSeek-V4's attention (``mindtrain.models.deepseek_v4.attention``, counted from its
    code, float32): the query latent and its norm, the queries (unweighted norm, rope), the one
    key/value head (norm, rope; neither norm under ``qk_layernorm: false``), the compressed entries appended to the keys, the scores over
    all S keys plus the entries and the sink (the model masks the window rather than slicing
    it), the output (rope undone, grouped low-rank projection). ``self_attn.compressor``: the
    pooling (its projections, gates, softmax, normed and roped entries) and, in compressed
    sparse layers, the indexer (its pooling, queries and relu scores; no backward through the
    choice, its pooling's tensors are kept all the same)."""
    h, n, d, qr, c, t = m.hidden_size, z.heads, m.head_dim, m.q_lora_rank, z.c, z.ta
    kinds = families.v4_attention_kinds(m)
    kind = kinds[i] if i < len(kinds) else "sliding"        # an MTP module's attention: sliding-window
    ratio = int(m.compress_ratios[i]) if kind != "sliding" else 0
    entries = z.sk // ratio if kind != "sliding" else 0
    own = t * h * c if c != F32 else 0
    own += t * qr * c                                       # q latent
    if m.qk_layernorm:                                      # its norm and output (false: none)
        own += _rms(t, qr) + t * qr * F32
    elif c != F32:                                          # its float32 copy
        own += t * qr * F32
    own += t * n * d * c + 2 * t * n * d * F32              # q, its unweighted norm
    own += 3 * t * n * d * F32 + t * n * d * F32            # rope (rotated, two products), transposed
    own += t * d * c + 3 * t * d * F32                      # the key/value head, rope
    if m.qk_layernorm:                                      # its norm (false: none; a float32 copy)
        own += _rms(t, d)
    elif c != F32:
        own += t * d * F32
    own += z.b * (z.sk + entries) * d * F32                 # keys with the entries appended
    own += 5 * t * n * d * F32                              # output, transposed, rope undone
    groups = m.o_groups * n // m.num_attention_heads         # this rank's groups (tensor parallelism splits them)
    own += t * n * d * F32 + 2 * t * groups * m.o_lora_rank * F32   # grouped projection
    children = []
    if entries:
        def pooling(dim: int, width: int) -> int:
            slots = 2 * ratio if kind == "csa" else ratio
            return (2 * t * width * c + 4 * z.b * entries * slots * dim * F32   # kv, gate; the slots, softmax
                    + _rms(z.b * entries, dim) + 3 * z.b * entries * dim * F32)  # norm, rope
        comp = pooling(d, 2 * d if kind == "csa" else d)
        if kind == "csa":
            ni, ci = m.index_n_heads, m.index_head_dim
            comp += pooling(ci, 2 * ci) + 4 * t * ni * ci * F32 + 3 * z.b * z.s * ni * entries * F32
        children.append(Module("self_attn.compressor", comp))
    scores = z.b * n * z.s * (z.sk + entries + 1)
    children.append(Module("self_attn.core_attention", 2 * scores * F32))  # the probabilities and their slice
    return Module("self_attn", own, children)


def _hyper_connections(m: ModelConfig, z: _Shapes) -> int:
    """DeepSeek-V4's two hyper-connections per layer (``deepseek_v4.hyper``): the normed
    flattened streams, the mixing logits, the Sinkhorn iterations' matrices, the collapse and
    the update (mixed streams, the spread output, their sum); without them
    (``enable_hyper_connections: false``) the two residual sums."""
    hc, h, t = m.hc_mult, m.hidden_size, z.tl
    if not m.enable_hyper_connections:
        return 2 * t * h * F32
    one = 2 * t * hc * h * F32 + t * (2 + hc) * hc * F32 + 2 * m.hc_sinkhorn_iters * t * hc * hc * F32
    one += t * hc * h * F32 + 3 * t * hc * h * F32
    return 2 * one


def _attention(m: ModelConfig, z: _Shapes, dims: ParallelDims, i: int = 0) -> Module:
    if m.model_type in families.QWEN3_FAMILIES:
        return _gqa_attention(m, z, dims)
    if m.model_type == "deepseek_v4" and m.experimental_attention_variant != "mla":
        return _v4_attention(m, i, z)
    h, n, c = m.hidden_size, z.heads, z.c   # DeepSeek-V3's MLA (also V4's mla variant)
    dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    kl, ql = m.kv_lora_rank, m.q_lora_rank
    t = z.ta
    own = 0
    if z.tl != z.ta or c != F32:
        own += t * h * c                      # the gathered (or cast) input of the projections
    q_in = ql or h
    if ql:
        own += t * ql * c                     # q_a_proj output (the q norm's input)
        if m.qk_layernorm:
            own += _rms(t, ql) + t * ql * F32     # q_a_layernorm and its output
        if c != F32:
            own += t * ql * c
    own += 2 * t * n * dr * c                 # rope halves of q (times cos / sin)
    own += t * n * (dn + dr) * c              # q
    own += t * kl * c                         # latent kv
    if m.qk_layernorm:
        own += _rms(t, kl) + t * kl * F32     # its norm and output
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
    if m.n_shared_experts and m.model_type not in families.QWEN3_FAMILIES:
        children.append(_mlp("mlp.shared_experts", z.ta, h, z.moe_inter * m.n_shared_experts, c, False))
    own = z.ta * h * c if z.ta != z.tl else 0             # tokens gathered over TP
    return Module("mlp", own, children)


def layer_module(m: ModelConfig, i: int, z: _Shapes, dims: ParallelDims) -> Module:
    """Layer ``i``'s kept tensors as a module tree (paths as the model's cells name them)."""
    h = m.hidden_size
    tl = z.tl
    children = [Module("input_layernorm", _rms(tl, h)), _attention(m, z, dims, i),
                Module("post_attention_layernorm", _rms(tl, h))]
    if i not in families.moe_layer_ids(m):
        children.append(_mlp("mlp", z.ta, h, z.inter, z.c, z.ta != z.tl))
    else:
        children.append(_moe(m, z, dims))
    # the norm outputs (the regions' inputs) and the mid-layer residual
    own = 3 * tl * h * F32
    if i >= m.num_hidden_layers:  # MTP: embedding of the shifted tokens, both norms, their concat
        own += tl * h * F32 + 2 * (_rms(tl, h) + tl * h * F32) + 2 * tl * h * F32
    if m.model_type == "deepseek_v4":
        own += _hyper_connections(m, z)
    return Module("", own, children)


def _layer_input(m: ModelConfig, i: int, z: _Shapes) -> int:
    n = z.tl * m.hidden_size * F32
    if m.model_type == "deepseek_v4":  # the hyper-connection streams (1 without them)
        return families.residual_streams(m) * n
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


def _causal_blocks_built(cfg: MindTrainConfig, m: ModelConfig, dims: ParallelDims, plain_cores: list) -> bool:
    """True when the model builds causal row blocks of its mask: a compiled model whose mask is
    the square causal one (no context parallelism, no per-document mask) and one of whose
    attention cores runs plainly (``plain_cores``: per layer, not recomputed in row blocks).
    DeepSeek-V4 attends through its own masks. (An attention whose LoRA adapter has dropout
    runs eagerly and takes none; not told apart here: counted as taking them.)"""
    data = cfg.train_dataset.dataloader.config
    packed = data is not None and data.reset_attention_mask
    return (bool(cfg.compile.enable) and m.model_type != "deepseek_v4" and dims.cp == 1 and not packed
            and any(plain_cores) and causal_block_rows(m.seq_length) > 0)


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
    block at a time (:data:`mindtrain.config.recompute.ROW_BLOCK_ELEMENTS`) when the model's
    rule says so (:func:`mindtrain.config.recompute.core_in_row_blocks`: eager layers, and
    compiled ones whose sequence's scores exceed a block)."""
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
    # the trainer builds the model compiled with compile.enable; a recomputed core runs in
    # blocks where the model's rule says so, once the micro-batch's scores exceed a block
    rows = recompute_rules.ROW_BLOCK_ELEMENTS
    in_blocks = scores > rows and recompute_rules.core_in_row_blocks(bool(cfg.compile.enable), m.num_attention_heads,
                                                                      m.seq_length, rows)
    block = min(s, max(1, rows // m.seq_length)) * m.seq_length  # one block's scores
    largest_scores = 0  # the scores one attention backward holds at once
    plain_cores = []  # per layer: its attention core runs whole (not recomputed in row blocks)
    for i in layer_ids:
        mod = layer_module(m, i, z, dims)
        blocked = in_blocks and _core_recomputed(i, *cores)
        plain_cores.append(not blocked)
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
    if _causal_blocks_built(cfg, m, dims, plain_cores):
        # the causal row blocks compiled cores read (mindtrain-models' plan_causal_blocks):
        # (G + 1) / 2G of the mask again, cut per head as the mask is
        mask += b * m.num_attention_heads * causal_block_elements(m.seq_length) * F32
    if m.model_type == "deepseek_v4":  # one cached [S, S] window mask; the head collapses the streams first
        mask = s * m.seq_length * F32 if layer_ids else 0
        if "head" in units:
            kept += 3 * z.tl * families.residual_streams(m) * h * F32
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
    saves: bool = True
    """checkpoint.enable_save: the run saves (its save peak is reported)."""
    optimizer: str = "AdamW"
    """optimizer.type (Muon: one buffer per matrix, and the update gathers on the host)."""

    @property
    def compiled(self) -> bool:
        """The model runs compiled (ms.jit) pieces: ``compile.enable`` (every layout)."""
        return self.compile_enabled

    @property
    def worst(self) -> StageBytes:
        return max(self.stages, key=lambda s: s.total)

    @property
    def worst_save(self) -> StageBytes:
        return max(self.stages, key=lambda s: s.save_peak)

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
    table = param_specs(m)
    if cfg.lora_config is not None:
        table = with_adapters(table, cfg)
    p = cfg.parallelism
    chunks = p.pipeline_parallel_interleave_num if dims.pp > 1 else 1
    parts = rank_units(m, dims, p.pipeline_parallel_layers_per_stage, chunks)
    stages = []
    for r, units in enumerate(parts):
        st = stage_bytes(cfg, dims, r, units, table, accum)
        st.runtime = RUNTIME_BYTES.get(device.upper(), 0)
        if device.upper() != "CPU":  # host memory, not the device's
            st.host_transient = st.save_buffer = 0
        else:  # FSDP gathers over the shared-memory transport (the CPU default) into numpy arrays
            st.gathered_on_host = dims.dp_shard > 1
        if dispatches_synchronously(device) and st.units_replay:
            # the runtime dispatches synchronously there: ZeRO-3 units release their
            # weights' storage in place and keep their activations, replaying nothing
            # (mindtrain.parallel.fsdp.synchronous_dispatch)
            st.units_replay, st.graph_held = False, 0
        full_rc = RecomputeConfig(mode="full")
        # ZeRO-3 units replay each layer's forward in its backward: full recompute in effect
        st.activations = activation_bytes(cfg, dims, units, c, full_rc if st.units_replay else None)
        st.activations_none = activation_bytes(cfg, dims, units, c, RecomputeConfig(mode="None"), st.breakdown)
        st.activations_full = activation_bytes(cfg, dims, units, c, full_rc)
        if dims.pp > 1:
            # 1F1B: stage r has up to pp - r micro-batches between forward and backward;
            # each keeps its stage input and output (the stage recomputes its forward)
            in_flight = min(accum, dims.pp * chunks - r)
            act = cfg.training.local_batch_size * (m.seq_length // dims.cp // dims.tp) * m.hidden_size * F32
            if m.model_type == "deepseek_v4":  # the stages pass the hc_mult hyper-connection streams
                act *= families.residual_streams(m)
            st.in_flight = 2 * in_flight * act
        stages.append(st)
    fpt = flops_per_token(m)
    step = fpt * cfg.training.global_batch_size * m.seq_length
    return Estimate(dims=dims, strategy=p.data_parallel_shard_strategy, accumulation=accum, compute_dtype=dtype,
                    device=device, stages=stages, flops_per_token=fpt, flops_per_step=step,
                    device_memory=device_memory, recompute_mode=str(cfg.recompute.mode),
                    compile_enabled=bool(cfg.compile.enable), saves=bool(cfg.checkpoint.enable_save),
                    optimizer=str(cfg.optimizer.type))


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
    rows = [("runtime (MindSpore, host)", "runtime"), ("parameters (fp32, resident)", "params"),
            ("gathered weights (transient)", "gathered"), ("graph-held unit weights (compiled)", "graph_held"),
            ("gradients (fp32, peak)", "grads"),
            ("optimizer (Muon 1x, AdamW 2x fp32)" if est.optimizer == "Muon" else "optimizer (AdamW, 2 x fp32)",
             "optimizer"),
            ("activations (ZeRO-3 unit replay)" if any(s.units_replay for s in cols)
             else f"activations / micro-batch ({est.recompute_mode})", "activations"),
            ("pipeline micro-batches in flight", "in_flight"), ("grad norm, Muon's gather (host)" if est.optimizer == "Muon" else "grad norm (host, float64)",
             "host_transient"),
            ("total: training peak", "total"), ("save buffer", "save_buffer"),
            ("save peak", "save_peak")]
    host = est.device.upper() == "CPU"
    for label, attr in rows:
        if (attr in ("in_flight", "graph_held") and not any(getattr(s, attr) for s in cols)) or (attr in ("runtime", "host_transient") and not host) or \
                (attr in ("save_buffer", "save_peak") and not (est.saves and host)):
            continue
        lines.append(label.ljust(34) + "".join(_gb(getattr(s, attr), unit).rjust(14) for s in cols))
    lines.append("activations, no recompute".ljust(34) + "".join(_gb(s.activations_none, unit).rjust(14) for s in cols))
    lines.append("activations, full recompute".ljust(34) + "".join(_gb(s.activations_full, unit).rjust(14) for s in cols))
    kinds = ", ".join(f"{k} {_gb(v, unit)}" for k, v in worst.breakdown.items())
    lines.append(f"activations without recompute ({uname}{', stage %d' % worst.stage if d.pp > 1 else ''}): {kinds}")
    lines.append(f"FLOPs per step: {est.flops_per_step:.4g} ({est.flops_per_token:.4g} per token x "
                 f"{est.flops_per_step / est.flops_per_token:,.0f} tokens); per device "
                 f"{est.flops_per_step / d.world_size:.4g}")
    if est.compiled and est.device.upper() == "CPU":
        lines.append("note: compiled (ms.jit) layers on CPU measured up to 20% above this total (their kept "
                     "tensors and gradients are not reused by the memory pool; package README, Memory estimate)")
    if est.device_memory is None:
        lines.append("fit: no device memory given (set context.max_device_memory or pass --device-memory)")
    else:
        lines.append(f"device memory: {_gb(est.device_memory)} GB ({est.memory_source})")
        cap = est.device_memory
        # on CPU the device's memory is the host's, which the save's buffer takes too
        save = est.saves and host
        peak = max(est.stages, key=lambda s: max(s.total, s.save_peak)) if save else worst
        need = max(peak.total, peak.save_peak) if save else peak.total
        diff = need - cap
        where = f" (stage {peak.stage})" if d.pp > 1 else ""
        if diff > 0:
            lines.append(f"does NOT fit: needs {_gb(need)} GB per device{where}, {_gb(cap)} GB available: "
                         f"{_gb(diff)} GB over ({need / cap:.1f}x)")
        else:
            lines.append(f"fits: needs {_gb(need)} GB per device{where} of {_gb(cap)} GB "
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
