"""Cross-field rules. Each violation raises ConfigError naming the full field path."""

from __future__ import annotations

import re

from typing import Optional

from mindtrain.config.derived import (check_degrees, check_zero_strategy, num_accumulation_steps, resolve_parallelism,
                                      total_lr_steps, warmup_steps)
from mindtrain.config.errors import ConfigError
from mindtrain.config.families import MODEL_TYPES, QWEN3_FAMILIES, head_dim, moe_layer_ids, unread_fields
from mindtrain.config.fsdp_policy import reshard_after_forward
from mindtrain.config.rampup import BatchRamp
from mindtrain.config.pipeline import check_micro_batches, layer_counts, microbatch_note, resolve_schedule
from mindtrain.config.recompute import layer_ids, recompute_plan
from mindtrain.config.schema import (
    GPTDatasetConfig,
    MindTrainConfig,
    ModelConfig,
    ParallelismConfig,
    TrainDatasetConfig,
)

LR_SCHEDULES = {
    # type -> fields (besides the common ones) that the schedule reads
    "ConstantWarmUpLR": set(),
    "LinearWithWarmUpLR": {"lr_end"},
    "CosineWithWarmUpLR": {"lr_end", "num_cycles"},
    "PolynomialWithWarmUpLR": {"lr_end", "power"},
    "WarmUpStableDecayLR": {"lr_end", "decay_ratio"},
    "ConstantWithCoolDownLR": {"lr_end", "decay_ratio"},
}
BASE_COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids"]
DTYPES = ("float32", "float16", "bfloat16")


def _positive(value: int, path: str) -> None:
    if value < 1:
        raise ConfigError(path, f"must be a positive integer, got {value}")


def _non_negative(value: float, path: str) -> None:
    if value < 0:
        raise ConfigError(path, f"must be >= 0, got {value}")


_SPLIT_NUMBER = re.compile(r"[.0-9]+")
_SPLIT_SEPARATORS = re.compile(r"[\s,/]*")


def split_weights(split: str, path: str = "train_dataset.dataloader.config.split") -> list[float]:
    """The one split grammar: Megatron's (the numbers in the string, e.g. ``"98,1,1"``,
    ``"1, 0, 0"``; ``/`` and spaces also separate) -> [train, test, eval] weights as written,
    padded with zeros to 3. Anything but numbers and separators is an error."""
    text = str(split)
    numbers = _SPLIT_NUMBER.findall(text)
    if _SPLIT_SEPARATORS.fullmatch(_SPLIT_NUMBER.sub(",", text)) is None or not numbers:
        raise ConfigError(path, f"must be comma-separated numbers like \"1, 0, 0\", got {split!r}")
    try:
        weights = [float(x) for x in numbers]
    except ValueError:  # "1..2"
        raise ConfigError(path, f"must be comma-separated numbers like \"1, 0, 0\", got {split!r}") from None
    if len(weights) > 3:
        raise ConfigError(path, f"needs at most 3 weights [train, test, eval], got {split!r}")
    weights += [0.0] * (3 - len(weights))
    if sum(weights) <= 0:
        raise ConfigError(path, f"weights must be >= 0 with a positive sum, got {split!r}")
    return weights


def parse_split(split: str, path: str = "train_dataset.dataloader.config.split") -> list[float]:
    """'1, 0, 0' -> normalised [train, test, eval] weights (grammar: :func:`split_weights`)."""
    weights = split_weights(split, path)
    total = sum(weights)
    return [w / total for w in weights]


def parse_data_path(data_path: list[str], path: str = "train_dataset.dataloader.config.data_path"
                    ) -> tuple[list[str], Optional[list[float]]]:
    """Flat [weight, prefix, weight, prefix, ...] -> (prefixes, weights normalised to 1).

    A single prefix without a weight is accepted (weights None), as in Megatron.
    """
    if len(data_path) == 1:
        return [data_path[0]], None
    if len(data_path) % 2:
        raise ConfigError(path, f"must be pairs of weight and .bin/.idx prefix, got {len(data_path)} entries")
    weights, prefixes = [], []
    for i in range(0, len(data_path), 2):
        w, prefix = data_path[i], data_path[i + 1]
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(f"{path}[{i}]", f"must be a sampling weight (a number) before the prefix, got {w!r}") from None
        if weight <= 0:
            raise ConfigError(f"{path}[{i}]", f"weight must be > 0, got {w!r}")
        try:
            float(prefix)
            raise ConfigError(f"{path}[{i + 1}]", f"must be a .bin/.idx prefix, got the number {prefix!r}")
        except ValueError:
            pass
        weights.append(weight)
        prefixes.append(prefix)
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def validate_model(m: ModelConfig, path: str = "model") -> None:
    """Rules on the model section alone (the models package calls this too)."""
    if m.model_type not in MODEL_TYPES:
        raise ConfigError(f"{path}.model_type", f"unknown model type {m.model_type!r}; known: {', '.join(MODEL_TYPES)}")
    if m.architectures != MODEL_TYPES[m.model_type]:
        raise ConfigError(f"{path}.architectures",
                          f"must be {MODEL_TYPES[m.model_type]!r} for model_type {m.model_type!r}, got {m.architectures!r}")
    for name, owner in unread_fields(m):
        raise ConfigError(f"{path}.{name}", f"is a {owner} setting, which a {m.model_type} model does not read; "
                                            f"remove it (or set model_type){_INSTEAD.get((m.model_type, name), '')}")
    if m.model_type in QWEN3_FAMILIES:
        _validate_qwen3(m, path)
    elif m.model_type == "deepseek_v4":
        _validate_deepseek_v4(m, path)
    else:
        _validate_deepseek_v3(m, path)
    _validate_common(m, path)


# what a field of another family is called in this one (appended to the unread-field error)
_INSTEAD = {
    ("qwen3_moe", "first_k_dense_replace"): "; Qwen3-MoE places dense layers with mlp_only_layers and "
                                            "decoder_sparse_step",
    ("qwen3_moe", "aux_loss_alpha"): "; Qwen3-MoE's load-balancing loss is router_aux_loss_coef with "
                                     "output_router_logits",
    ("qwen3_moe", "n_shared_experts"): "; Qwen3-MoE has no shared experts",
    ("qwen3_moe", "routed_scaling_factor"): "; Qwen3-MoE does not scale its routing weights",
    ("deepseek_v3", "tie_word_embeddings"): "; DeepSeek-V3 has its own lm_head",
    ("deepseek_v4", "first_k_dense_replace"): "; every DeepSeek-V4 layer is a mixture of experts "
                                              "(num_hash_layers of them hash-routed)",
    ("deepseek_v4", "intermediate_size"): "; DeepSeek-V4 has no dense MLP (moe_intermediate_size sizes "
                                          "the experts)",
}


def _validate_deepseek_v3(m: ModelConfig, path: str) -> None:
    for name in ("seq_length", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
                 "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "max_position_embeddings"):
        _positive(getattr(m, name), f"{path}.{name}")
    if m.q_lora_rank is not None:
        _positive(m.q_lora_rank, f"{path}.q_lora_rank")
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"{path}.qk_rope_head_dim", f"must be even (rotary pairs), got {m.qk_rope_head_dim}")
    if m.num_key_value_heads != m.num_attention_heads:
        raise ConfigError(f"{path}.num_key_value_heads",
                          f"MLA uses one key/value head per query head; set it to num_attention_heads ({m.num_attention_heads})")
    if not 0 <= m.first_k_dense_replace <= m.num_hidden_layers:
        raise ConfigError(f"{path}.first_k_dense_replace",
                          f"must be between 0 and num_hidden_layers ({m.num_hidden_layers}), got {m.first_k_dense_replace}")
    has_moe = m.first_k_dense_replace < m.num_hidden_layers or m.num_nextn_predict_layers > 0
    if has_moe:
        _positive(m.n_routed_experts, f"{path}.n_routed_experts")
        _positive(m.n_group, f"{path}.n_group")
        _positive(m.num_experts_per_tok, f"{path}.num_experts_per_tok")
        _non_negative(m.n_shared_experts, f"{path}.n_shared_experts")
        if m.n_routed_experts % m.n_group:
            raise ConfigError(f"{path}.n_routed_experts",
                              f"{m.n_routed_experts} is not divisible by n_group ({m.n_group})")
        if not 1 <= m.topk_group <= m.n_group:
            raise ConfigError(f"{path}.topk_group", f"must be between 1 and n_group ({m.n_group}), got {m.topk_group}")
        reachable = m.topk_group * (m.n_routed_experts // m.n_group)
        if m.num_experts_per_tok > reachable:
            raise ConfigError(f"{path}.num_experts_per_tok",
                              f"{m.num_experts_per_tok} exceeds the {reachable} experts reachable in topk_group "
                              f"({m.topk_group}) groups of {m.n_routed_experts // m.n_group}")
        if (m.n_routed_experts // m.n_group) < 2 and m.n_group > 1:
            raise ConfigError(f"{path}.n_group", "each group needs at least 2 experts (group score = sum of its top 2)")
    kind = _silu_and_rope_kind(m, path)
    if kind == "yarn" and float(m.rope_scaling.get("factor", 0)) <= 0:
        raise ConfigError(f"{path}.rope_scaling.factor", "must be > 0 for yarn scaling")


def _validate_deepseek_v4(m: ModelConfig, path: str) -> None:
    """DeepSeek-V4: one shared key/value head, queries through a low-rank projection, hybrid
    sliding / compressed attention per layer, hyper-connection streams, hash-routed then
    learned mixtures of experts."""
    for name in ("seq_length", "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "qk_rope_head_dim", "max_position_embeddings", "hc_mult", "n_routed_experts",
                 "num_experts_per_tok"):
        _positive(getattr(m, name), f"{path}.{name}")
    _non_negative(m.hc_sinkhorn_iters, f"{path}.hc_sinkhorn_iters")  # 0: one column normalisation (HF, MindFormers)
    _non_negative(m.n_shared_experts, f"{path}.n_shared_experts")
    _non_negative(m.swiglu_limit, f"{path}.swiglu_limit")
    if m.enable_hc_head and not m.enable_hyper_connections:  # MindFormers refuses it too
        raise ConfigError(f"{path}.enable_hc_head", "true needs the hyper-connection streams it collapses "
                                                    "(enable_hyper_connections: false); set it to false")
    if m.experimental_attention_variant not in ("dsv4_hybrid", "mla"):
        raise ConfigError(f"{path}.experimental_attention_variant", f"must be dsv4_hybrid (sliding / compressed "
                          f"attention, HF's) or mla (DeepSeek-V3's attention), got {m.experimental_attention_variant!r}")
    if m.num_hash_layers > m.num_hidden_layers or m.num_hash_layers < 0:
        raise ConfigError(f"{path}.num_hash_layers", f"must be between 0 and num_hidden_layers "
                                                     f"({m.num_hidden_layers}), got {m.num_hash_layers}")
    if m.num_experts_per_tok > m.n_routed_experts:
        raise ConfigError(f"{path}.num_experts_per_tok", f"{m.num_experts_per_tok} exceeds n_routed_experts "
                                                         f"({m.n_routed_experts})")
    if m.scoring_func not in ("sqrtsoftplus", "sigmoid"):
        raise ConfigError(f"{path}.scoring_func", f"must be sqrtsoftplus or sigmoid, got {m.scoring_func!r}")
    if m.experimental_attention_variant == "mla":
        _validate_v4_mla(m, path)
        return
    for name in ("sliding_window", "o_groups", "o_lora_rank"):
        _positive(getattr(m, name), f"{path}.{name}")
    extra = [int(r) for r in m.compress_ratios[m.num_hidden_layers:m.num_hidden_layers + m.num_nextn_predict_layers]]
    if any(extra):
        raise ConfigError(f"{path}.compress_ratios", f"the MTP modules' entries (past num_hidden_layers) must be 0: "
                                                     f"their attention is sliding-window only, got {extra}")
    if not m.head_dim:
        raise ConfigError(f"{path}.head_dim", "DeepSeek-V4 needs head_dim (the one key/value head's size, also each "
                                              "query head's and value's), e.g. 512")
    if m.q_lora_rank is None or m.q_lora_rank <= 0:
        raise ConfigError(f"{path}.q_lora_rank", "DeepSeek-V4 projects queries through a low rank; set it > 0")
    if m.num_key_value_heads != 1:
        raise ConfigError(f"{path}.num_key_value_heads", f"DeepSeek-V4 shares one key/value head; set it to 1, "
                                                         f"got {m.num_key_value_heads}")
    if m.qk_rope_head_dim % 2 or m.qk_rope_head_dim > m.head_dim:
        raise ConfigError(f"{path}.qk_rope_head_dim", f"must be even and at most head_dim ({m.head_dim}), "
                                                      f"got {m.qk_rope_head_dim}")
    if (m.num_attention_heads * m.head_dim) % m.o_groups:
        raise ConfigError(f"{path}.o_groups", f"{m.o_groups} must divide num_attention_heads x head_dim "
                                              f"({m.num_attention_heads * m.head_dim})")
    n = m.num_hidden_layers
    ratios = list(m.compress_ratios)
    if len(ratios) < n:
        raise ConfigError(f"{path}.compress_ratios", f"needs one entry per layer ({n}: 0 sliding window, 4 "
                                                     f"compressed sparse, e.g. 128 heavily compressed), got {len(ratios)}")
    if any(int(r) < 0 for r in ratios):
        raise ConfigError(f"{path}.compress_ratios", f"entries must be >= 0, got {ratios}")
    if 4 in ratios[:n]:
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            _positive(getattr(m, name), f"{path}.{name}")
        if m.qk_rope_head_dim > m.index_head_dim:
            raise ConfigError(f"{path}.index_head_dim", f"must be at least qk_rope_head_dim ({m.qk_rope_head_dim}), "
                                                        f"got {m.index_head_dim}")
    _silu_and_rope_kind(m, path)


def _validate_v4_mla(m: ModelConfig, path: str) -> None:
    """DeepSeek-V4's mla variant: DeepSeek-V3's attention sizes and rope in V4's layers."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        _positive(getattr(m, name), f"{path}.{name}")
    if m.q_lora_rank is not None:
        _positive(m.q_lora_rank, f"{path}.q_lora_rank")
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"{path}.qk_rope_head_dim", f"must be even (rotary pairs), got {m.qk_rope_head_dim}")
    kind = _silu_and_rope_kind(m, path)
    if kind == "yarn" and float(m.rope_scaling.get("factor", 0)) <= 0:
        raise ConfigError(f"{path}.rope_scaling.factor", "must be > 0 for yarn scaling")


def _silu_and_rope_kind(m: ModelConfig, path: str):
    """The DeepSeek families' shared checks: SiLU gating and YaRN (or no) rope scaling; returns
    the rope scaling kind (None without scaling)."""
    if m.hidden_act != "silu":
        raise ConfigError(f"{path}.hidden_act", f"only 'silu' is supported, got {m.hidden_act!r}")
    if m.rope_scaling is None:
        return None
    kind = m.rope_scaling.get("type", m.rope_scaling.get("rope_type"))
    if kind not in ("yarn", "default", None):
        raise ConfigError(f"{path}.rope_scaling.type", f"only 'yarn' is supported, got {kind!r}")
    return kind


def _validate_qwen3(m: ModelConfig, path: str) -> None:
    """Qwen3 and Qwen3-MoE: grouped-query attention with q/k norms over head_dim, SwiGLU MLPs,
    (Qwen3-MoE) softmax top-k routing over the experts of the layers HF's rule makes MoE."""
    for name in ("seq_length", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
        _positive(getattr(m, name), f"{path}.{name}")
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(f"{path}.num_key_value_heads", f"{m.num_key_value_heads} must divide num_attention_heads "
                                                         f"({m.num_attention_heads}): each key/value head serves a "
                                                         "group of query heads")
    if m.head_dim is not None:
        _positive(m.head_dim, f"{path}.head_dim")
    d = head_dim(m)
    if d < 2 or d % 2:
        raise ConfigError(f"{path}.head_dim", f"must be even (rotary pairs), got {d}"
                                              + ("" if m.head_dim else " (hidden_size // num_attention_heads)"))
    if m.hidden_act != "silu":
        raise ConfigError(f"{path}.hidden_act", f"only 'silu' is supported, got {m.hidden_act!r}")
    if m.model_type == "qwen3_moe":
        _positive(m.decoder_sparse_step, f"{path}.decoder_sparse_step")
        for i, layer in enumerate(m.mlp_only_layers or ()):
            if not 0 <= layer < m.num_hidden_layers:
                raise ConfigError(f"{path}.mlp_only_layers[{i}]", f"must be a layer id in 0..{m.num_hidden_layers - 1}, "
                                                                  f"got {layer}")
        _non_negative(m.n_routed_experts, f"{path}.n_routed_experts")
        if moe_layer_ids(m):
            _positive(m.moe_intermediate_size, f"{path}.moe_intermediate_size")
            _positive(m.num_experts_per_tok, f"{path}.num_experts_per_tok")
            if m.num_experts_per_tok > m.n_routed_experts:
                raise ConfigError(f"{path}.num_experts_per_tok", f"{m.num_experts_per_tok} exceeds n_routed_experts "
                                                                 f"({m.n_routed_experts})")
        _non_negative(m.router_aux_loss_coef, f"{path}.router_aux_loss_coef")
    if m.rope_scaling is not None:
        kind = m.rope_scaling.get("type", m.rope_scaling.get("rope_type"))
        if kind not in ("yarn", "linear", "default", None):
            raise ConfigError(f"{path}.rope_scaling.type", f"only 'linear' and 'yarn' scaling are supported, got {kind!r}")
        if kind in ("yarn", "linear") and float(m.rope_scaling.get("factor") or 0) <= 0:
            raise ConfigError(f"{path}.rope_scaling.factor", f"must be > 0 for {kind} scaling")


def _validate_common(m: ModelConfig, path: str) -> None:
    for name in ("compute_dtype", "param_init_dtype"):
        if getattr(m, name) not in DTYPES:
            raise ConfigError(f"{path}.{name}", f"must be one of {', '.join(DTYPES)}, got {getattr(m, name)!r}")
    for name in ("layernorm_compute_dtype", "softmax_compute_dtype", "rotary_dtype", "router_dense_type"):
        value = getattr(m, name)
        if value is not None and value not in DTYPES:
            raise ConfigError(f"{path}.{name}", f"must be one of {', '.join(DTYPES)}, got {value!r}")
    for name in ("attention_dropout", "hidden_dropout"):
        value = getattr(m, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"{path}.{name}", f"must be a probability in [0, 1), got {value!r}")
    _non_negative(m.num_nextn_predict_layers, f"{path}.num_nextn_predict_layers")
    _non_negative(m.aux_loss_alpha, f"{path}.aux_loss_alpha")
    _non_negative(m.bias_update_speed, f"{path}.bias_update_speed")
    _non_negative(m.mtp_loss_scaling_factor, f"{path}.mtp_loss_scaling_factor")
    if m.rms_norm_eps <= 0:
        raise ConfigError(f"{path}.rms_norm_eps", f"must be > 0, got {m.rms_norm_eps}")


def _v4_context_parallel(p: ParallelismConfig, m: ModelConfig, path: str) -> None:
    """DeepSeek-V4's context parallelism. Colossal: the hybrid attention's is MindFormers'
    compressed-attention scheme (each of the 2 x context_parallel chunks a whole number of
    compressed windows), the mla variant's DeepSeek-V3's (keys and values all-gathered).
    Ulysses / hybrid: the hybrid attention's queries go to head groups by all-to-all, its one
    shared key/value head and compressed entries are all-gathered over the CP group (the
    compressors still pool each rank's own chunks: the same window rule); the mla variant's
    is DeepSeek-V3's. The MTP modules' inputs are shifted on the whole sequence before it is
    cut, as DeepSeek-V3's."""
    if m.experimental_attention_variant == "mla":
        return  # no compressed windows
    chunk = m.seq_length // (2 * p.context_parallel)
    for ratio in sorted({int(r) for r in (m.compress_ratios or ())[:m.num_hidden_layers] if int(r) > 1}):
        if chunk % ratio:
            raise ConfigError(f"{path}.context_parallel", f"{p.context_parallel}: DeepSeek-V4 needs each of the "
                              f"2 x context_parallel chunks (seq_length / {2 * p.context_parallel} = {chunk} tokens) "
                              f"to be a multiple of every compress ratio ({ratio}); use fewer CP ranks or a longer "
                              f"seq_length")


def validate_parallelism(p: ParallelismConfig, m: ModelConfig) -> None:
    path = "parallelism"
    check_degrees(p)
    check_zero_strategy(p.data_parallel_shard_strategy)
    reshard_after_forward(p.reshard_after_forward_policy, p.data_parallel_shard_strategy, p.pipeline_parallel > 1)
    tp = p.tensor_parallel
    if m.model_type == "deepseek_v4":
        if m.experimental_attention_variant != "mla" and m.o_groups % tp:
            # the grouped output projection splits by whole groups (each rank's query heads)
            raise ConfigError(f"{path}.tensor_parallel", f"{tp} must divide model.o_groups ({m.o_groups}): "
                                                         f"DeepSeek-V4's grouped output projection splits by groups")
    if m.num_attention_heads % tp:
        raise ConfigError(f"{path}.tensor_parallel",
                          f"{tp} must divide model.num_attention_heads ({m.num_attention_heads})")
    if m.model_type in QWEN3_FAMILIES and m.num_key_value_heads % tp:
        raise ConfigError(f"{path}.tensor_parallel",
                          f"{tp} must divide model.num_key_value_heads ({m.num_key_value_heads})")
    for name in ("vocab_size", "intermediate_size", "moe_intermediate_size", "seq_length"):
        if getattr(m, name) % tp:
            raise ConfigError(f"{path}.tensor_parallel", f"{tp} must divide model.{name} ({getattr(m, name)})")
    if m.n_routed_experts % p.expert_parallel:
        raise ConfigError(f"{path}.expert_parallel",
                          f"{p.expert_parallel} must divide model.n_routed_experts ({m.n_routed_experts})")
    cp = p.context_parallel
    if cp > 1 and m.seq_length % (2 * cp):
        raise ConfigError(f"{path}.context_parallel",
                          f"model.seq_length ({m.seq_length}) must be divisible by 2 x context_parallel = {2 * cp}")
    method, uly = p.context_parallel_method, p.ulysses_degree_in_cp
    if method not in ("colossal", "ulysses", "hybrid"):
        raise ConfigError(f"{path}.context_parallel_method", f"{method!r} is not a method; use colossal "
                          f"(load-balanced causal chunks with all-gathered keys/values), ulysses or hybrid")
    if cp > 1 and m.model_type == "deepseek_v4":
        _v4_context_parallel(p, m, path)
    if uly is not None and (not isinstance(uly, int) or uly < 1):
        raise ConfigError(f"{path}.ulysses_degree_in_cp", f"must be a positive integer, got {uly!r}")
    if cp > 1 and method == "ulysses" and uly not in (None, cp):
        raise ConfigError(f"{path}.ulysses_degree_in_cp", f"Ulysses context parallelism runs over all "
                          f"{cp} CP ranks, got {uly}; remove it or use context_parallel_method: hybrid")
    if cp > 1 and method == "hybrid" and (uly is None or not 1 < uly < cp or cp % uly):
        raise ConfigError(f"{path}.ulysses_degree_in_cp", f"hybrid context parallelism needs 1 < "
                          f"ulysses_degree_in_cp < context_parallel ({cp}) dividing it, got {uly}; set one "
                          f"or use context_parallel_method: ulysses")
    degree = {"ulysses": cp, "hybrid": uly}.get(method) if cp > 1 else None
    if degree:
        # MLA's keys and values have a head per query head; grouped-query attention's fewer;
        # DeepSeek-V4's hybrid attention's one shared key/value head is all-gathered, not split
        heads_of = [(m.num_attention_heads, "num_attention_heads")]
        if m.model_type in QWEN3_FAMILIES:
            heads_of.append((m.num_key_value_heads, "num_key_value_heads"))
        for heads, name in heads_of:
            if (heads // tp) % degree:
                raise ConfigError(f"{path}.context_parallel",
                                  f"{degree} Ulysses ranks must divide the {name} each tensor-parallel rank runs "
                                  f"({name} / tensor_parallel = {heads // tp}) for context_parallel_method: "
                                  f"{method}; use colossal")
    if cp > 1 and tp > 1 and (m.seq_length // cp) % tp:
        raise ConfigError(f"{path}.tensor_parallel",
                          f"{tp} must divide the per-rank sequence seq_length / context_parallel = {m.seq_length // cp}")
    dispatcher = p.moe_token_dispatcher_type
    if dispatcher not in ("alltoall", "alltoall_deredundancy"):
        raise ConfigError(f"{path}.moe_token_dispatcher_type",
                          f"{dispatcher!r} is not a dispatcher; use alltoall or alltoall_deredundancy")
    if dispatcher == "alltoall_deredundancy" and (p.expert_parallel < p.npu_nums_per_device
                                                  or p.expert_parallel % p.npu_nums_per_device):
        raise ConfigError(f"{path}.npu_nums_per_device",
                          f"{p.npu_nums_per_device}: alltoall_deredundancy needs expert_parallel "
                          f"({p.expert_parallel}) to be a multiple of npu_nums_per_device (as MindFormers "
                          f"requires); set npu_nums_per_device to the ranks per device, at most expert_parallel")
    validate_pipeline(p, m)


def validate_pipeline(p: ParallelismConfig, m: ModelConfig) -> None:
    """Schedule, interleave count, layers per stage and micro-batch field (MindFormers' forms)."""
    resolve_schedule(p.pipeline_parallel_schedule, p.pipeline_parallel_interleave_num)
    layer_counts(p.pipeline_parallel_layers_per_stage, m.num_hidden_layers, p.pipeline_parallel,
                 p.pipeline_parallel_interleave_num)
    if p.pipeline_parallel_interleave_num > 1 and p.pipeline_parallel == 1:
        raise ConfigError("parallelism.pipeline_parallel_interleave_num",
                          f"{p.pipeline_parallel_interleave_num} chunks need pipeline_parallel > 1; set it to 1")
    microbatch_note(p.pipeline_parallel_microbatch_size, 1, 1)  # its type; the count needs the world size


def _validate_mind_dataset(dl, path: str) -> None:
    """MindDataset reads MindRecord files: dataset_files is required; the Megatron loader's
    datasets_type, sizes and config are not used."""
    files = dl.dataset_files
    if isinstance(files, str):
        files = [files]
    if not files or not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{path}.dataset_files", "is required for MindDataset: a .mindrecord file, a list of them, "
                          f"or a folder holding them; got {dl.dataset_files!r}")
    if not dl.column_names or "input_ids" not in dl.column_names:
        raise ConfigError(f"{path}.column_names", f"must name the MindRecord columns to read, starting with "
                          f"input_ids; got {dl.column_names}")


def validate_dataset(d: TrainDatasetConfig, m: ModelConfig) -> None:
    path = "train_dataset.dataloader"
    dl = d.dataloader
    if dl.type == "MindDataset":
        _validate_mind_dataset(dl, path)
        _non_negative(d.num_parallel_workers, "train_dataset.num_parallel_workers")
        return
    if dl.type != "BlendedMegatronDatasetDataLoader":
        raise ConfigError(f"{path}.type", f"must be 'BlendedMegatronDatasetDataLoader' or 'MindDataset', got {dl.type!r}")
    if dl.datasets_type is None:
        raise ConfigError(f"{path}.datasets_type", "is required for BlendedMegatronDatasetDataLoader; set it to \"GPTDataset\"")
    if dl.datasets_type != "GPTDataset":
        raise ConfigError(f"{path}.datasets_type", f"must be \"GPTDataset\", got {dl.datasets_type!r}")
    if dl.sizes is None:
        raise ConfigError(f"{path}.sizes", "is required for BlendedMegatronDatasetDataLoader: [train, test, eval] sample counts")
    if len(dl.sizes) != 3 or any(s < 0 for s in dl.sizes):
        raise ConfigError(f"{path}.sizes", f"must be 3 non-negative sample counts [train, test, eval], got {dl.sizes}")
    if dl.config is None:
        raise ConfigError(f"{path}.config", "is required for BlendedMegatronDatasetDataLoader (seq_length, split, eod, pad, data_path, ...)")
    c: GPTDatasetConfig = dl.config
    cpath = f"{path}.config"
    _positive(c.seq_length, f"{cpath}.seq_length")
    if c.seq_length != m.seq_length:
        raise ConfigError(f"{cpath}.seq_length", f"{c.seq_length} must equal model.seq_length ({m.seq_length})")
    if c.data_path:
        if c.split is None:
            raise ConfigError(f"{cpath}.split", "required when data_path is set, e.g. \"1, 0, 0\"")
        parse_data_path(c.data_path, f"{cpath}.data_path")
    if c.split is not None:
        parse_split(c.split, f"{cpath}.split")
    _positive(c.eod_pad_length, f"{cpath}.eod_pad_length")
    if c.create_attention_mask and c.create_compressed_eod_mask:
        raise ConfigError(f"{cpath}.create_compressed_eod_mask",
                          "cannot be combined with create_attention_mask; choose one attention_mask form")
    wants_mask = c.create_attention_mask or c.create_compressed_eod_mask
    expected = BASE_COLUMNS + (["attention_mask"] if wants_mask else [])
    if list(dl.column_names) != expected:
        why = ("attention_mask is created" if wants_mask else "no attention_mask is created")
        raise ConfigError(f"{path}.column_names", f"must be {expected} because {why}, got {dl.column_names}")
    _non_negative(d.num_parallel_workers, "train_dataset.num_parallel_workers")


def validate_validation(cfg: MindTrainConfig) -> None:
    """The ``validation`` section: a positive frequency, a batch count (or -1), and eval data
    (a split with documents, or a data_path)."""
    v = cfg.validation
    _positive(v.freq, "validation.freq")
    if v.steps != -1:
        _positive(v.steps, "validation.steps")
    if v.split not in ("valid", "test"):
        raise ConfigError("validation.split", f"must be valid or test, got {v.split!r}")
    if v.data_path is not None:
        if not v.data_path:
            raise ConfigError("validation.data_path", "is empty; give weight/prefix pairs, e.g. ['1', './data/eval_text_document'], "
                              "or remove it to use the validation split")
        parse_data_path(list(v.data_path), "validation.data_path")
        if v.steps == -1 and len(v.data_path) > 1:
            raise ConfigError("validation.steps", "-1 (all of the eval data) needs validation.data_path without "
                              "weights (one prefix); with weighted prefixes give a number of global batches")
        return
    if not v.enable:
        return
    c = cfg.train_dataset.dataloader.config
    if cfg.train_dataset.dataloader.type == "MindDataset" or c is None:
        raise ConfigError("validation.data_path", "is required with a MindDataset loader: give the .bin/.idx eval data")
    if c.split is not None:
        index = 1 if v.split == "valid" else 2
        weights = split_weights(c.split)
        if len(weights) <= index or weights[index] <= 0:
            raise ConfigError("validation.split", f"train_dataset.dataloader.config.split {c.split!r} gives the {v.split} "
                              "split no documents; give it a share (e.g. \"98, 2, 0\") or set validation.data_path")


def ns_schedule(o) -> list[tuple[float, float, float]]:
    """Muon's Newton-Schulz coefficients per step from ``optimizer.ns_coefficients``: a flat
    ``[a, b, c]`` repeated ``ns_steps`` times, or MindFormers' schedule ``[[[a, b, c], n], ...]``
    (each triple ``n`` times; ``ns_steps`` is then ignored, as MindFormers does)."""
    where = "optimizer.ns_coefficients"
    c = o.ns_coefficients
    number = (int, float)
    if not isinstance(c, list) or not c:
        raise ConfigError(where, f"must be [a, b, c] or [[[a, b, c], n], ...], got {c!r}")
    if all(isinstance(v, number) and not isinstance(v, bool) for v in c):
        if len(c) != 3:
            raise ConfigError(where, f"a flat form must be 3 numbers [a, b, c], got {c!r}")
        if isinstance(o.ns_steps, bool) or not isinstance(o.ns_steps, int) or o.ns_steps < 1:
            raise ConfigError("optimizer.ns_steps", f"must be a positive integer, got {o.ns_steps!r}")
        return [tuple(float(v) for v in c)] * o.ns_steps
    out: list[tuple[float, float, float]] = []
    for i, seg in enumerate(c):
        ok = (isinstance(seg, list) and len(seg) == 2 and isinstance(seg[0], list) and len(seg[0]) == 3
              and all(isinstance(v, number) and not isinstance(v, bool) for v in seg[0])
              and isinstance(seg[1], int) and not isinstance(seg[1], bool) and seg[1] >= 1)
        if not ok:
            raise ConfigError(f"{where}[{i}]", f"must be [[a, b, c], n] with n a positive integer, got {seg!r}")
        out += [tuple(float(v) for v in seg[0])] * seg[1]
    return out


def _validate_muon(o) -> None:
    if not 0 <= o.momentum < 1:
        raise ConfigError("optimizer.momentum", f"must be in [0, 1), got {o.momentum}")
    ns_schedule(o)
    if o.matched_adamw_rms <= 0:
        raise ConfigError("optimizer.matched_adamw_rms", f"must be > 0, got {o.matched_adamw_rms}")
    if len(o.adamw_betas) != 2 or not all(0 <= b < 1 for b in o.adamw_betas):
        raise ConfigError("optimizer.adamw_betas", f"must be two numbers in [0, 1), got {o.adamw_betas}")
    if o.adamw_eps <= 0:
        raise ConfigError("optimizer.adamw_eps", f"must be > 0, got {o.adamw_eps}")
    if o.adamw_include is not None and not all(isinstance(p, str) and p for p in o.adamw_include):
        raise ConfigError("optimizer.adamw_include", f"must be a list of glob strings, got {o.adamw_include!r}")
    if o.qk_clip_threshold <= 0:
        raise ConfigError("optimizer.qk_clip_threshold", f"must be > 0, got {o.qk_clip_threshold}")


def _validate_max_logits(cfg: MindTrainConfig) -> None:
    """QK-clip and the max-logit monitor: what the model's attention can report."""
    o, m = cfg.optimizer, cfg.model
    clip = o.type == "Muon" and o.qk_clip_enabled
    mla = m.model_type == "deepseek_v3" or (m.model_type == "deepseek_v4" and m.experimental_attention_variant == "mla")
    if clip and not mla:
        raise ConfigError("optimizer.qk_clip_enabled", f"MindFormers' QK-clip scales MLA attention weights "
                          f"(DeepSeek-V3, DeepSeek-V4's mla variant) only and leaves a {m.model_type} model's "
                          f"alone; set it to false "
                          f"(callbacks: [{{type: MaxLogitsMonitor}}] reports the max attention logits)")


def validate_config(cfg: MindTrainConfig, world_size: Optional[int] = None) -> None:
    """Check every rule; with ``world_size``, also the parallel layout and accumulation."""
    if cfg.context.mode != 1:
        raise ConfigError("context.mode", f"only eager mode (1) is supported, got {cfg.context.mode}")
    if cfg.context.device_target not in (None, "Ascend", "CPU", "GPU"):
        raise ConfigError("context.device_target", f"must be Ascend, CPU or GPU, got {cfg.context.device_target!r}")
    t = cfg.training
    for name in ("steps", "local_batch_size", "global_batch_size", "log_interval", "max_skipped_steps"):
        _positive(getattr(t, name), f"training.{name}")
    ck = cfg.checkpoint
    _non_negative(ck.save_interleaved_steps, "checkpoint.save_interleaved_steps")
    _non_negative(ck.save_max, "checkpoint.save_max")
    if ck.layout not in ("mindtrain", "mindformers"):
        raise ConfigError("checkpoint.layout", f"must be 'mindtrain' or 'mindformers', got {ck.layout!r}")
    o = cfg.optimizer
    if o.type not in ("AdamW", "Muon"):
        raise ConfigError("optimizer.type", f"must be 'AdamW' or 'Muon', got {o.type!r}")
    if o.type == "Muon":
        _validate_muon(o)
    elif o.qk_clip_enabled:
        raise ConfigError("optimizer.qk_clip_enabled", f"QK-clip is part of Muon (MindFormers ignores it with "
                          f"{o.type}); set it to false, or optimizer.type: Muon")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError("optimizer.betas", f"must be two numbers in [0, 1), got {o.betas}")
    if o.eps <= 0:
        raise ConfigError("optimizer.eps", f"must be > 0, got {o.eps}")
    _non_negative(o.weight_decay, "optimizer.weight_decay")
    lr = cfg.lr_scheduler
    if lr.type not in LR_SCHEDULES:
        raise ConfigError("lr_scheduler.type", f"unknown schedule {lr.type!r}; known: {', '.join(LR_SCHEDULES)}")
    defaults = type(lr)()
    for name in ("lr_end", "power", "num_cycles", "decay_ratio"):
        if getattr(lr, name) != getattr(defaults, name) and name not in LR_SCHEDULES[lr.type]:
            raise ConfigError(f"lr_scheduler.{name}", f"is not used by {lr.type}; remove it")
    _non_negative(lr.learning_rate, "lr_scheduler.learning_rate")
    if not 0 <= lr.warmup_ratio <= 1:
        raise ConfigError("lr_scheduler.warmup_ratio", f"must be between 0 and 1, got {lr.warmup_ratio}")
    if lr.total_steps is not None:
        _positive(lr.total_steps, "lr_scheduler.total_steps")
    if lr.warmup_steps is not None:
        _non_negative(lr.warmup_steps, "lr_scheduler.warmup_steps")
    if warmup_steps(lr, total_lr_steps(cfg)) > total_lr_steps(cfg):
        raise ConfigError("lr_scheduler.warmup_steps", f"exceeds the schedule's {total_lr_steps(cfg)} steps")
    if not 0 < lr.decay_ratio <= 1:
        raise ConfigError("lr_scheduler.decay_ratio", f"must be in (0, 1], got {lr.decay_ratio}")
    validate_model(cfg.model)
    validate_parallelism(cfg.parallelism, cfg.model)
    _validate_max_logits(cfg)
    validate_dataset(cfg.train_dataset, cfg.model)
    validate_validation(cfg)
    ramp = BatchRamp.from_config(cfg.training)
    validate_mindformers_sections(cfg)
    if cfg.context.device_target is not None:
        validate_device(cfg, cfg.context.device_target)
    if world_size is not None:
        dims = resolve_parallelism(cfg.parallelism, world_size)
        p = cfg.parallelism
        schedule = resolve_schedule(p.pipeline_parallel_schedule, p.pipeline_parallel_interleave_num)
        check_micro_batches(schedule, dims.pp, num_accumulation_steps(cfg, dims))
        if ramp is not None:
            per = dims.dp * cfg.training.local_batch_size
            ramp.check_units(per, f"data_parallel_shard x local_batch_size = {dims.dp}x{cfg.training.local_batch_size}")
            for size in ramp.sizes():
                check_micro_batches(schedule, dims.pp, size // per)


def validate_device(cfg: MindTrainConfig, device: str) -> None:
    """Rules that depend on the device the job runs on. ``validate_config`` applies them to
    ``context.device_target`` when it is set; the trainer applies them again to the device
    it chose (Ascend when present, else CPU) when it is not."""
    if cfg.swap.enable and device.upper() != "CPU":
        raise ConfigError("swap.enable", f"activation offload to host is not built for {device}; set it to false "
                                         "and use recompute (recompute.mode: full or select) to save activation memory")
    if cfg.parallelism.cpu_offload and device.upper() != "CPU":
        raise ConfigError("parallelism.cpu_offload", f"offloading FSDP shards and optimizer state to host memory is not "
                                                     f"built for {device}; set it to false")


# ------------------------------------------------------------------ MindFormers' other sections
RECOMPUTE_MODES = ("None", "full", "select")


def _layer_ranges(value, path: str) -> None:
    """Layer selections as MindFormers writes them (the one grammar: recompute.layer_ids)."""
    if not isinstance(value, bool):  # true/false: all layers or none
        layer_ids(value, 1 << 30, path)


def _select_module(value, path: str) -> None:
    if value is None:
        return
    if isinstance(value, dict):
        for module, layers in value.items():
            if not isinstance(module, str) or not module:
                raise ConfigError(path, f"keys must be module paths like \"layers.*.mlp\", got {module!r}")
            if layers is not None:
                _layer_ranges(layers, f"{path}.{module}")
        return
    if isinstance(value, list) and all(isinstance(m, str) and m for m in value):
        return
    raise ConfigError(path, "must map module paths to layer ranges ({\"layers.*.mlp\": [0-3]}) or list module "
                            f"paths, got {value!r}")


def _swap_entries(value, path: str, key: str) -> None:
    if value is None:
        return
    entries = value if isinstance(value, list) else [value]
    for i, entry in enumerate(entries):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(where, f"must be a mapping like {{{key}: ..., layers: [0-3], backward_prefetch: 1}}, "
                                     f"got {entry!r}")
        if key == "op_name" and not entry.get("op_name"):
            raise ConfigError(f"{where}.op_name", "is required: the operator (or list of them) to swap")
        if "layers" not in entry:
            raise ConfigError(f"{where}.layers", "is required: the layer ids or ranges to swap, or true for all")
        _layer_ranges(entry["layers"], f"{where}.layers")
        prefetch = entry.get("backward_prefetch", 1)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ConfigError(f"{where}.backward_prefetch", f"must be an integer >= 0, got {prefetch!r}")


def validate_mindformers_sections(cfg: MindTrainConfig) -> None:
    """recompute, recompute_comm, swap, profiler, monitor and callbacks forms; and MindFormers
    fields whose feature mindtrain does not have and that change the training itself (refused)."""
    r = cfg.recompute
    if r.mode not in RECOMPUTE_MODES:
        raise ConfigError("recompute.mode", f"must be one of {', '.join(RECOMPUTE_MODES)}, got {r.mode!r}")
    _select_module(r.select_module, "recompute.select_module")
    m = cfg.model
    n_layers = m.num_hidden_layers + (m.num_nextn_predict_layers or 0)
    layer_ids(r.full_recompute_layer, n_layers, "recompute.full_recompute_layer")
    recompute_plan(r, n_layers)
    if r.exclude_op is not None and not all(isinstance(o, str) and o for o in r.exclude_op):
        raise ConfigError("recompute.exclude_op", f"must be a list of operator names, got {r.exclude_op!r}")
    _select_module(cfg.recompute_comm.select_module, "recompute_comm.select_module")
    sw = cfg.swap
    _non_negative(sw.default_prefetch, "swap.default_prefetch")
    _swap_entries(sw.layer_swap, "swap.layer_swap", "layers")
    _swap_entries(sw.op_swap, "swap.op_swap", "op_name")
    pr = cfg.profiler
    _positive(pr.start_step, "profiler.start_step")
    _positive(pr.end_step, "profiler.end_step")
    if pr.start_step > pr.end_step:
        raise ConfigError("profiler.start_step", f"{pr.start_step} must be <= profiler.end_step ({pr.end_step})")
    if pr.profiler_level not in (None, 0, 1, 2):
        raise ConfigError("profiler.profiler_level", f"must be 0, 1 or 2, got {pr.profiler_level!r}")
    if pr.profiler_rank is not None and any(r_ < 0 for r_ in pr.profiler_rank):
        raise ConfigError("profiler.profiler_rank", f"must list ranks >= 0, got {pr.profiler_rank}")
    mon = cfg.monitor
    hc = mon.health_checkpoint
    for name in ("embedding_local_norm_threshold", "global_norm_skip_threshold"):
        if hc is not None and getattr(hc, name) <= 0:
            raise ConfigError(f"monitor.health_checkpoint.{name}", f"must be > 0, got {getattr(hc, name)}")
    if hc is not None:
        _positive(hc.global_norm_skip_time, "monitor.health_checkpoint.global_norm_skip_time")
    ts = mon.train_state
    for name in ("local_norm", "device_norm"):
        value = getattr(ts, name)
        if isinstance(value, list) and not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"monitor.train_state.{name}", f"must be true/false, a name pattern or a list of "
                                                            f"them, got {value!r}")
    mm = mon.moe_monitor
    if mm.save_tokens_per_expert_interval is not None:
        _positive(mm.save_tokens_per_expert_interval, "monitor.moe_monitor.save_tokens_per_expert_interval")
    if isinstance(mm.target_layers, int):
        _positive(mm.target_layers, "monitor.moe_monitor.target_layers")
    elif isinstance(mm.target_layers, list) and any(x < 0 for x in mm.target_layers):
        raise ConfigError("monitor.moe_monitor.target_layers", f"layer ids must be >= 0, got {mm.target_layers}")
    _non_negative(mon.hang_timeout, "monitor.hang_timeout")
    _positive(mon.tensorboard.log_interval, "monitor.tensorboard.log_interval")
    _positive(mon.tensorboard.queue_size, "monitor.tensorboard.queue_size")
    for i, cb in enumerate(cfg.callbacks):
        if not isinstance(cb.type, str) or not cb.type:
            raise ConfigError(f"callbacks[{i}].type", "is required: the registered callback class name")
    validate_lora(cfg)
    _refuse_unsupported(cfg)


_LORA_FAMILIES = ("deepseek_v3", "deepseek_v4", "qwen3", "qwen3_moe")


def validate_lora(cfg: MindTrainConfig) -> None:
    """``lora_config`` (MindFormers' PyNative LoraConfig): its fields, and what it is not built with."""
    lc = cfg.lora_config
    if lc is None:
        return
    if not isinstance(lc.target_modules, str) or not lc.target_modules:
        raise ConfigError("lora_config.target_modules", "is required: a regex searched in MindFormers' module "
                          "paths, e.g. 'linear_qkv|linear_proj|linear_fc1|linear_fc2'")
    for field_name in ("target_modules", "exclude_layers"):
        value = getattr(lc, field_name)
        if value is None:
            continue
        try:
            re.compile(value)
        except (re.error, TypeError) as err:
            raise ConfigError(f"lora_config.{field_name}", f"{value!r} is not a regex ({err}); fix the pattern")
    _positive(lc.lora_rank, "lora_config.lora_rank")
    if not lc.lora_alpha > 0:
        raise ConfigError("lora_config.lora_alpha", f"must be > 0 (the scale is lora_alpha / lora_rank), "
                          f"got {lc.lora_alpha!r}")
    _non_negative(lc.lora_a_std, "lora_config.lora_a_std")
    _non_negative(lc.lora_b_std, "lora_config.lora_b_std")
    if not 0.0 <= lc.lora_dropout < 1.0:
        raise ConfigError("lora_config.lora_dropout", f"must be in [0, 1), got {lc.lora_dropout!r}")
    family = getattr(cfg.model, "model_type", "deepseek_v3")
    if family not in _LORA_FAMILIES:
        raise ConfigError("lora_config", f"LoRA on model_type {family} is not supported yet (DeepSeek-V3, "
                          "DeepSeek-V4, Qwen3 and Qwen3-MoE are); remove the lora_config section")
    if cfg.optimizer.type == "Muon" and cfg.optimizer.qk_clip_enabled:
        raise ConfigError("optimizer.qk_clip_enabled", "QK-clip scales the query and key weights, which LoRA "
                          "freezes (the adapters saved alone would no longer give the trained model); set it "
                          "to false with lora_config")


# Fields that would change training and are not built: (field path, is it set?, what it is
# (value -> text), what to do). One line each, "<field>: <what> is not supported yet; <what to do>".
_NOT_BUILT = (
    ("parallelism.context_parallel_mask_type", lambda v: v != "causal", repr, "set it to causal"),
)


def _refuse_unsupported(cfg: MindTrainConfig) -> None:
    for path, is_set, what, instead in _NOT_BUILT:
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        if is_set(value):
            raise ConfigError(path, f"{what(value)} is not supported yet; {instead}")
    p = cfg.parallelism
    if p.tensor_parallel > 1 and p.sequence_parallel is False:
        raise ConfigError("parallelism.sequence_parallel", f"must be true when tensor_parallel > 1 "
                          f"({p.tensor_parallel}), as in MindFormers' PyNative trainer; set it to true")
    etp = p.expert_tensor_parallel
    if etp is not None and etp not in (1, p.tensor_parallel):
        raise ConfigError("parallelism.expert_tensor_parallel",
                          f"must be 1 (experts whole on every tensor-parallel rank, MindFormers' only value), "
                          f"equal tensor_parallel ({p.tensor_parallel}, experts split like the dense MLPs) or be "
                          f"null (the same), got {etp}")
