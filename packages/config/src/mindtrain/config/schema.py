"""The YAML schema: one dataclass per section, field names and defaults as in MindFormers'
PyNative TrainConfig (mindformers/pynative/config/config.py); mindtrain's earlier names are
aliases (see ``loader.ALIASES``).

Each field carries its documentation as an attribute docstring. ``None`` marks a value that has no safe default and must be given where it is
used (the validator says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class CheckpointConfig:
    enable_save: bool = True
    """Write safetensors checkpoints under ``save_path``."""
    save_path: str = ""
    """Folder that receives one sub-folder per saved step and the tracker file; required
    when enable_save is true (``--output_dir`` gives a default)."""
    save_max: int = 5
    """Keep only the newest this many checkpoints; 0 keeps all. (mindtrain alias: keep_last)"""
    save_interleaved_steps: int = 1000
    """Save every this many steps (and at the end); 0 saves only at the end.
    (mindtrain alias: save_interval)"""
    no_save_optim: bool = False
    """Save the model weights only (no optimizer, scheduler, data and RNG state)."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training goes on."""
    prefix: Optional[str] = "checkpoint"
    """File-name prefix of saved checkpoint files."""
    remove_redundancy: bool = False
    """Each replicated tensor is written by one rank only."""
    load_path: str = ""
    """Resume from this checkpoint folder (or the folder holding the tracker file), or
    start from the weights of a Hugging Face model directory (one with config.json)."""
    load_balanced: bool = False
    """MindFormers: spread checkpoint reading over ranks (no effect on CPU; said at start-up)."""
    no_load_optim: bool = False
    """When resuming, load the model weights only, not optimizer, scheduler, data position
    and RNG state. (mindtrain alias: load_optimizer, with the opposite meaning)"""
    load_worker_number: int = 1
    """MindFormers: threads that read checkpoint files (each rank reads its share in one
    thread; another value is said at start-up)."""
    save_global_layout_cache: bool = True
    """MindFormers: cache the global sharding layout between saves."""
    reshard_worker_num: int = 1
    """MindFormers: threads that reshard a loaded checkpoint to this layout."""
    layout: str = "mindtrain"
    """Folder layout of saved checkpoints: 'mindtrain' (iter_NNNNNNN/: each rank's pieces,
    metadata.json; mindtrain-export-hf makes an HF directory) or 'mindformers' (iteration_NNNNNNNN/ with {prefix}-model/-opt files, common.json and
    metadata.json, as MindFormers' PyNative trainer writes). Loading reads either."""


@dataclass
class TrainingConfig:
    steps: int = 1000
    """Number of optimizer steps."""
    local_batch_size: int = 1
    """Samples per device per forward pass (micro-batch size)."""
    global_batch_size: int = 1
    """Samples per optimizer step over all data-parallel ranks, including accumulation."""
    max_norm: float = 1.0
    """Clip gradients to this global L2 norm; <= 0 disables clipping."""
    seed: int = 42
    """Seed for parameter initialisation and every other random draw."""
    deterministic: bool = False
    """Ask MindSpore for deterministic kernels (same results run after run)."""
    rampup_batch_size: Optional[list[int]] = None
    """MindFormers' batch-size ramp-up [start_global_batch_size, batch_size_increment,
    rampup_samples]: the global batch grows by the increment every rampup_samples / levels
    consumed samples up to global_batch_size (:mod:`mindtrain.config.rampup`)."""
    log_interval: int = 1
    """Print the step line every this many steps."""
    max_skipped_steps: int = 5
    """Stop when this many consecutive steps have a non-finite loss or gradient."""


@dataclass
class ParallelismConfig:
    data_parallel_shard: int = -1
    """FSDP degree; -1 takes all devices that the other degrees leave."""
    data_parallel_shard_strategy: str = "optim_grads_params"
    """What FSDP shards: "optim" (optimizer state), "optim_grads", or
    "optim_grads_params" (ZeRO-3, the default). (mindtrain alias: data_parallel_sharding_strategy)"""
    reshard_after_forward_policy: str = "default"
    """ZeRO-3: free gathered weights after forward: "always", "never" or "default"."""
    cpu_offload: bool = False
    """MindFormers: offload FSDP shards to host memory."""
    disable_gradient_division: bool = True
    """MindFormers: FSDP sums gradients instead of averaging (the loss is already scaled)."""
    dense_fsdp_shard_size: Optional[int] = None
    """HSDP: shard the dense (non-expert) weights over groups of this many data-parallel
    ranks and replicate them across the groups (their gradients are reduced within a group,
    then averaged across groups); null or data_parallel_shard is plain FSDP. Routed experts
    keep the whole data-parallel group. Not with pipeline or context parallelism."""
    tensor_parallel: int = 1
    """Tensor-parallel degree; sequence parallelism is always on when this is > 1."""
    context_parallel: int = 1
    """Context-parallel degree (sequence split over ranks)."""
    context_parallel_method: str = "colossal"
    """How context parallelism splits attention: "colossal" (load-balanced causal chunks with
    all-gathered keys/values), "ulysses" (all-to-all between sequence chunks and head groups) or
    "hybrid" (Ulysses within groups of ulysses_degree_in_cp ranks, keys/values gathered across)."""
    context_parallel_async: bool = False
    """MindFormers: asynchronous context-parallel hooks."""
    ulysses_degree_in_cp: Optional[int] = None
    """Ulysses degree inside context parallelism: required with "hybrid" (1 < it < context_parallel,
    dividing it), equal to context_parallel (or unset) with "ulysses"."""
    context_parallel_mask_type: str = "causal"
    """Attention mask type of the context-parallel input preparation."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree (number of stages)."""
    pipeline_parallel_layers_per_stage: Optional[Any] = "auto"
    """Decoder layers on each stage; "auto"/null balances layers by count.
    (mindtrain alias: pipeline_layers_per_stage)"""
    pipeline_parallel_schedule: str = "1f1b"
    """Pipeline schedule: "1f1b", "interleaved_1f1b" or "gpipe". (mindtrain alias: pipeline_schedule)"""
    pipeline_parallel_microbatch_size: int = 1
    """MindFormers' pipeline micro-batch setting."""
    pipeline_parallel_interleave_num: int = 1
    """Model chunks per pipeline stage (virtual stages); > 1 runs interleaved 1F1B."""
    pipeline_parallel_overlap_p2p: bool = False
    """MindFormers: overlap pipeline send/receive with compute."""
    pipeline_parallel_overlap_b_f: bool = False
    """MindFormers: overlap one micro-batch's backward with another's forward."""
    pipeline_parallel_enable_dxdw_split: bool = False
    """MindFormers: split input and weight gradients in the pipeline backward."""
    pipeline_parallel_p2p_transport: str = "plain"
    """MindFormers: how pipeline send/receive are issued ("plain", "auto")."""
    sequence_parallel: Optional[bool] = None
    """Sequence parallelism; on whenever tensor_parallel > 1 (null: follow tensor_parallel;
    false with tensor_parallel > 1 is refused, as MindFormers' PyNative trainer does).
    MindFormers' default: false."""
    enable_mc2: bool = False
    """MindFormers: fused matmul + communication kernels (Ascend)."""
    enable_loss_parallel: bool = False
    """Vocab-parallel loss: keep the logits split over tensor-parallel ranks."""
    expert_parallel: int = 1
    """Expert-parallel degree; borrows ranks from data_parallel_shard x context_parallel."""
    expert_tensor_parallel: Optional[int] = None
    """Tensor-parallel degree inside the experts; mindtrain uses tensor_parallel (or 1)."""
    npu_nums_per_device: int = 8
    """MindFormers: NPU ranks per device, for the deduplicating token dispatcher."""
    moe_token_dispatcher_type: str = "alltoall"
    """MoE token dispatcher: "alltoall" or "alltoall_deredundancy"."""
    expert_parallel_async_d2h: bool = False
    """MindFormers: overlap the expert-parallel count copy to host with compute."""
    expert_parallel_use_safe_tokens: bool = True
    """MindFormers: one zero-weight token per expert so no expert group is empty."""
    param_dtype: Optional[str] = None
    """FSDP mixed precision: dtype of the gathered weights used in compute."""
    reduce_dtype: Optional[str] = None
    """FSDP mixed precision: dtype of the gradient reduction."""


@dataclass
class OptimizerConfig:
    type: str = "AdamW"
    """Optimizer; "AdamW" (decoupled weight decay, no decay on norms and biases) or "Muon"
    (Newton-Schulz-orthogonalised momentum for 2-D weights and per-expert matrices, AdamW for
    the rest)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2 (type Muon uses adamw_betas instead)."""
    eps: float = 1.0e-8
    """Adam epsilon; with type Muon, the epsilon of the Newton-Schulz input normalisation
    X / (||X||_F + eps) (MindFormers passes it there; the AdamW part uses adamw_eps)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    weight_decay_include: Optional[list[str]] = None
    """Parameter-name patterns that get weight decay even if they would not."""
    weight_decay_exclude: Optional[list[str]] = None
    """Parameter-name patterns that get no weight decay."""
    momentum: float = 0.95
    """Muon: momentum of the update buffer (m = momentum * m + grad)."""
    nesterov: bool = True
    """Muon: Newton-Schulz input grad + momentum * m (Nesterov) instead of m."""
    ns_steps: int = 5
    """Muon: Newton-Schulz iterations with a flat ns_coefficients [a, b, c]; a schedule
    [[[a, b, c], n], ...] sets its own count (sum of n) and this is ignored, as in MindFormers."""
    ns_coefficients: list[Any] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    """Muon: Newton-Schulz coefficients, a flat [a, b, c] used for every step or MindFormers'
    schedule [[[a, b, c], n], ...] (each triple for n consecutive steps)."""
    matched_adamw_rms: float = 0.2
    """Muon: update RMS matched to AdamW's: the orthogonalised update is scaled by
    matched_adamw_rms * sqrt(max(rows, cols)) (Moonlight)."""
    adamw_betas: list[float] = field(default_factory=lambda: [0.95, 0.95])
    """Muon: beta1, beta2 of the AdamW that updates the non-Muon parameters."""
    adamw_eps: float = 1.0e-8
    """Muon: epsilon of the AdamW that updates the non-Muon parameters."""
    adamw_include: Optional[list[str]] = None
    """Muon: glob patterns of 2-D/3-D weights updated by AdamW instead of Muon, matched
    against the MindFormers name and mindtrain's; null: ["*word_embeddings*", "*output_layer*"]
    (the embedding and the LM head)."""
    use_fused_adamw: bool = False
    """Muon: accepted for MindFormers configs; mindtrain's AdamW is always one fused kernel
    per parameter (ops.FusedCastAdamWeightDecay with bias correction and clipping folded in),
    so it changes nothing."""
    qk_clip_enabled: bool = False
    """Muon: QK-clip after each update: every MLA head whose max pre-softmax attention logit of
    the step reaches qk_clip_threshold has its query nope rows and kv_b_proj key rows scaled by
    sqrt(threshold / max) and its query rope rows by threshold / max (MindFormers' rule;
    DeepSeek-V3 only; refused with AdamW)."""
    qk_clip_threshold: float = 100.0
    """Muon: the attention-logit threshold of QK-clip."""


@dataclass
class LRSchedulerConfig:
    type: str = "ConstantWarmUpLR"
    """One of ConstantWarmUpLR, LinearWithWarmUpLR, CosineWithWarmUpLR,
    PolynomialWithWarmUpLR, WarmUpStableDecayLR, ConstantWithCoolDownLR."""
    learning_rate: float = 1.0e-5
    """Peak learning rate."""
    warmup_ratio: float = 0.0
    """Warm-up length as a fraction of total_steps (used when warmup_steps is not set)."""
    warmup_steps: Optional[int] = None
    """Warm-up length in steps; overrides warmup_ratio."""
    warmup_lr_init: float = 0.0
    """Learning rate at step 0 of the warm-up."""
    total_steps: Optional[int] = None
    """Length of the schedule; defaults to training.steps."""
    lr_end: float = 0.0
    """Final learning rate of decaying schedules."""
    power: float = 1.0
    """PolynomialWithWarmUpLR: exponent of the decay."""
    num_cycles: float = 0.5
    """CosineWithWarmUpLR: number of cosine half-waves over the decay."""
    decay_ratio: float = 0.1
    """WarmUpStableDecayLR / ConstantWithCoolDownLR: fraction of total_steps spent in the
    final decay (cool-down)."""


@dataclass
class GPTDatasetConfig:
    seed: int = 1234
    """Seed of the document and sample shuffles (Megatron's random_seed)."""
    seq_length: int = 4096
    """Tokens per returned sample; must equal model.seq_length."""
    split: Optional[str] = None
    """Train/test/eval split weights, e.g. "1, 0, 0"; required when data_path is set."""
    eod: int = 1
    """Token id of end-of-document (eos) in the data."""
    pad: int = -1
    """Token id of padding in the data."""
    eod_mask_loss: bool = False
    """Mask the loss on end-of-document tokens."""
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""
    create_attention_mask: bool = False
    """Emit an attention_mask column (then column_names needs a fifth entry)."""
    reset_attention_mask: bool = False
    """Stop attention across documents inside one sample."""
    create_compressed_eod_mask: bool = False
    """Emit the per-sample document end positions (padded to eod_pad_length) as the
    attention_mask column instead of a full mask."""
    eod_pad_length: int = 128
    """Length of the compressed end-of-document list."""
    data_path: list[str] = field(default_factory=list)
    """Pairs of relative weight and .bin/.idx prefix (with _text_document)."""
    path_to_cache: Optional[str] = None
    """Folder for the cached index arrays; defaults to beside the data."""
    add_extra_token_to_sequence: bool = True
    """Read seq_length + 1 tokens per sample so labels are the inputs shifted by one."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files (zero-copy reads)."""
    num_dataset_builder_threads: int = 1
    """MindFormers: threads that build the index arrays (mindtrain: one; said at start-up)."""


@dataclass
class DataLoaderConfig:
    type: str = "BlendedMegatronDatasetDataLoader"
    """Loader type; "BlendedMegatronDatasetDataLoader"."""
    datasets_type: Optional[str] = None
    """Dataset class; "GPTDataset" for pretraining. Required."""
    sizes: Optional[list[int]] = None
    """[train, test, eval] sample counts; only train is used. Required."""
    column_names: list[str] = field(
        default_factory=lambda: ["input_ids", "labels", "loss_mask", "position_ids"])
    """Columns each sample yields, in order."""
    shuffle: bool = False
    """Shuffle the order of samples handed to the loader (the dataset itself is already
    shuffled the way Megatron does)."""
    config: Optional[GPTDatasetConfig] = None
    """The dataset's settings. Required for BlendedMegatronDatasetDataLoader."""
    dataset_files: Optional[Any] = None
    """MindDataset: a MindRecord file, a list of files, or a folder of them. Required there."""
    python_multiprocessing: bool = False
    """MindFormers: build samples in worker processes instead of threads."""


@dataclass
class TrainDatasetConfig:
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    """How samples are built and batched."""
    drop_remainder: bool = True
    """Drop a last global batch that is not full."""
    num_parallel_workers: int = 8
    """Background threads that prefetch batches."""
    prefetch_size: int = 1
    """Batches prepared ahead of the one in use."""
    numa_enable: bool = False
    """MindFormers: bind data workers to the device's NUMA node (no effect on CPU)."""
    use_distribute_dataset: bool = False
    """MindFormers: read on one rank per data-parallel group and broadcast the batch."""


@dataclass
class ModelConfig:
    """One flat model section for every family (``model_type``): ``deepseek_v3``
    (DeepseekV3ForCausalLM), ``deepseek_v4`` (DeepseekV4ForCausalLM), ``qwen3``
    (Qwen3ForCausalLM) and ``qwen3_moe`` (Qwen3MoeForCausalLM). The defaults are DeepSeek-V3's; each family reads its own fields
    (:data:`mindtrain.config.families.FAMILY_FIELDS`) and a field it does not read must keep
    its default (a one-line error names it)."""

    model_type: str = "deepseek_v3"
    """Registry key of the model family: deepseek_v3, deepseek_v4, qwen3 or qwen3_moe."""
    architectures: str = "DeepseekV3ForCausalLM"
    """Model class (a string, not a list): DeepseekV3ForCausalLM, Qwen3ForCausalLM or
    Qwen3MoeForCausalLM."""
    seq_length: int = 4096
    """Training sequence length; must equal the dataset's seq_length."""
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    """FFN size of the dense layers."""
    moe_intermediate_size: int = 2048
    """FFN size of each routed and shared expert."""
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    """Key/value heads. DeepSeek-V3 (MLA): equal to num_attention_heads. Qwen3: grouped-query
    attention, a divisor of num_attention_heads (MindFormers: num_query_groups)."""
    head_dim: Optional[int] = None
    """Qwen3: size of every query, key and value head, independent of hidden_size /
    num_attention_heads (Qwen3-8B: 128 with hidden 4096 and 32 heads); null means
    hidden_size // num_attention_heads (MindFormers: kv_channels). DeepSeek-V3 does not read
    it (its heads are qk_nope_head_dim + qk_rope_head_dim and v_head_dim)."""
    qk_layernorm: bool = True
    """RMSNorm over each query and key head: Qwen3's q_norm / k_norm over head_dim before
    rope, DeepSeek-V3's MLA latent norms (q_a_layernorm, kv_a_layernorm), DeepSeek-V4's query
    latent and key/value norms (q_a_norm, kv_norm; in its mla variant DeepSeek-V3's). False
    builds the model without them, as MindFormers does (its IdentityOp; V4's fixed per-head
    query norm and its compressors' and indexer's norms stay); such a model has no HF
    equivalent (HF always builds the norms), so mindtrain-export-hf refuses it. MindFormers'
    name."""
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = 1536
    """Rank of the query down-projection; null projects queries directly."""
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    """Expert groups for group-limited routing."""
    topk_group: int = 4
    """Groups each token may route into."""
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    """DeepSeek-V3: the first this many layers use a dense MLP instead of MoE."""
    norm_topk_prob: bool = True
    """Divide each token's top-k routing weights by their sum. HF Qwen3-MoE's default is
    false (config.json files give it; from_pretrained reads it)."""
    decoder_sparse_step: int = 1
    """Qwen3-MoE: layer i is a MoE layer when (i + 1) % decoder_sparse_step == 0 and it is
    not in mlp_only_layers (HF's rule); the others are dense (intermediate_size)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Qwen3-MoE: layer ids (0-based) that use a dense MLP whatever decoder_sparse_step says.
    MindFormers' moe_layer_freq (an int N: MoE where i % N == 0, or a 0/1 list) is read
    into it."""
    router_aux_loss_coef: float = 0.001
    """Qwen3-MoE: weight of HF's load-balancing loss (load_balancing_loss_func: E x sum_e
    f_e P_e over the micro-batch's tokens of all MoE layers together) in the loss, when
    output_router_logits is true (MindFormers: moe_aux_loss_coeff)."""
    output_router_logits: bool = False
    """Qwen3-MoE: add router_aux_loss_coef x the load-balancing loss to the loss, as HF's
    Qwen3MoeForCausalLM does when it outputs router logits (HF's default: false; the loss is
    reported either way)."""
    compress_ratios: list[int] = field(default_factory=list)
    """DeepSeek-V4: per layer, how many tokens each compressed key/value entry pools (MindFormers'
    name): 0 = sliding-window attention only, 4 = compressed sparse attention (overlapping
    gated pooling of 4 tokens, a lightning indexer keeping index_topk entries per query), any
    other ratio = heavily compressed attention (non-overlapping pooling; 128 in the released
    models). HF's layer_types + compress_rates are read into it. Entries past
    num_hidden_layers (MindFormers lists the MTP module's) are not read."""
    compress_rope_theta: float = 160000.0
    """DeepSeek-V4: rope base of the compressed layers (their queries, keys and compressed
    entries); rope_scaling (YaRN) applies to these only, without its attention factor."""
    sliding_window: int = 128
    """DeepSeek-V4: keys a query sees in every layer's sliding-window branch (itself included)."""
    o_groups: int = 8
    """DeepSeek-V4: head groups of the grouped low-rank output projection."""
    o_lora_rank: int = 1024
    """DeepSeek-V4: each head group's rank in the output projection."""
    index_n_heads: int = 64
    """DeepSeek-V4: query heads of the lightning indexer."""
    index_head_dim: int = 128
    """DeepSeek-V4: head size of the lightning indexer."""
    index_topk: int = 512
    """DeepSeek-V4: compressed entries each query keeps in compressed sparse attention."""
    hc_mult: int = 4
    """DeepSeek-V4: residual streams of the manifold-constrained hyper-connections."""
    hc_sinkhorn_iters: int = 20
    """DeepSeek-V4: Sinkhorn-Knopp iterations making the stream-mixing matrix doubly stochastic."""
    hc_eps: float = 1.0e-6
    """DeepSeek-V4: floor of the hyper-connection weights and Sinkhorn normalisation."""
    num_hash_layers: int = 3
    """DeepSeek-V4: the first this many layers route each token by a fixed token-id -> experts
    table (tid2eid) instead of a learned top-k (HF's mlp_layer_types "hash_moe")."""
    scoring_func: str = "sigmoid"
    """DeepSeek-V4: router score of each expert's logit: sqrtsoftplus (sqrt(softplus(x)), the
    released models' and HF's default, which config.json files read without the key get) or
    sigmoid (DeepSeek-V3's, the schema default: the defaults are DeepSeek-V3's)."""
    swiglu_limit: float = 10.0
    """DeepSeek-V4: the experts' SwiGLU clamps gate pre-activations above at this and up
    pre-activations to [-limit, limit]; 0 turns the clamp off."""
    experimental_attention_variant: str = "dsv4_hybrid"
    """DeepSeek-V4 (MindFormers' name): the attention of its layers: ``dsv4_hybrid`` (HF's:
    sliding / compressed sparse / heavily compressed per compress_ratios) or ``mla``
    (DeepSeek-V3's multi-latent attention in every layer, sized by q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim and v_head_dim; rope and YaRN as DeepSeek-V3's)."""
    enable_hyper_connections: bool = True
    """DeepSeek-V4 (MindFormers' name): the residual is hc_mult hyper-connection streams (mHC);
    false builds plain residual layers (MindFormers' TransformerLayer: no attn_hc / ffn_hc /
    hc_head) and needs enable_hc_head: false. HF has no such model (mindtrain-export-hf
    refuses it)."""
    enable_hc_head: bool = True
    """DeepSeek-V4 (MindFormers' name): the streams are collapsed before the final norms by the
    learned head (HF's hc_head: hc_fn, hc_base, hc_scale); false collapses them by their mean
    (MindFormers' collapse without the head, no parameters)."""
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    initializer_range: float = 0.02
    rms_norm_eps: float = 1.0e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    """YaRN settings: {type: yarn, factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim}. Qwen3 also takes {type: linear, factor} (HF's
    rope_type names either key); null is plain rope."""
    rope_interleave: bool = True
    """The checkpoint stores rope dims interleaved (as DeepSeek-V3 does)."""
    attention_bias: bool = False
    """Biases on the attention projections: DeepSeek-V3's q_a_proj, kv_a_proj_with_mqa and
    o_proj; Qwen3's q_proj, k_proj, v_proj and o_proj (HF's attention_bias)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities after the softmax, in training steps (DeepSeek-V3, Qwen3)."""
    tie_word_embeddings: bool = False
    """Qwen3: the output head uses the embedding matrix (no lm_head weight; HF's
    tie_word_embeddings, MindFormers' untie_embeddings_and_output_weights negated).
    DeepSeek-V3: false."""
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: Optional[int] = None
    num_nextn_predict_layers: int = 0
    """Multi-token-prediction modules; 0 turns MTP off."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss in the total loss."""
    aux_loss_alpha: float = 0.0001
    """Weight of the sequence-wise load-balancing loss; 0 turns it off."""
    bias_update_speed: float = 0.001
    """Aux-loss-free balancing: step of the expert-bias update; 0 turns it off."""
    compute_dtype: str = "bfloat16"
    """Matmul dtype (float32, float16, bfloat16); MindSpore's CPU backend has no bfloat16
    matmul, so bfloat16 runs as float32 there (said at start-up)."""
    param_init_dtype: str = "float32"
    """Master weight dtype (parameters, gradients, optimizer state). MindFormers'
    ``params_dtype: bfloat16`` runs as float32 on CPU (said at start-up); on other devices
    low-precision weights are not built (one-line error)."""
    # MindFormers-only switches (kernels, dtypes of parts of the compute): None = not set.
    # The MindFormers names that rename a field above are read by model_names.to_canonical.
    use_flash_attention: Optional[bool] = None
    """MindFormers: FlashAttention kernel (Ascend, fp16/bf16); CPU runs the portable attention."""
    moe_grouped_gemm: Optional[bool] = None
    """MindFormers: grouped-matmul kernel for the routed experts (Ascend)."""
    mla_qkv_concat: Optional[bool] = None
    """MindFormers: one fused matmul for the MLA q/kv down-projections (same math)."""
    expert_dtype: Optional[str] = None
    """DeepSeek-V4 (HF / MindFormers): the released experts' storage dtype (fp4); the experts
    compute with float32 weights on CPU (said at start-up)."""
    bias_swiglu_fusion: Optional[bool] = None
    """MindFormers: fused SwiGLU kernel (``hidden_act: fusedswiglu`` sets it)."""
    apply_rope_fusion: Optional[bool] = None
    """MindFormers: fused rotary-embedding kernel."""
    use_fused_ops_topkrouter: Optional[bool] = None
    """MindFormers: fused top-k router kernel."""
    use_attn_mask_compression: Optional[bool] = None
    """MindFormers: compressed causal mask for FlashAttention."""
    layernorm_compute_dtype: Optional[str] = None
    """MindFormers: dtype of the RMSNorm computation (mindtrain: float32 statistics)."""
    softmax_compute_dtype: Optional[str] = None
    """MindFormers: dtype of the attention softmax (mindtrain: float32)."""
    rotary_dtype: Optional[str] = None
    """MindFormers: dtype of the rotary cos/sin tables (mindtrain: float32)."""
    router_dense_type: Optional[str] = None
    """MindFormers: dtype of the router's matmul (mindtrain: float32)."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP / MoE outputs before their residual adds, in training
    steps; the same masks in every layout (DeepSeek-V3, Qwen3)."""
    moe_token_drop_policy: Optional[Any] = None
    """MindFormers: which tokens an over-full expert drops; mindtrain drops none (no capacity factor)."""
    use_pad_tokens: Optional[bool] = None
    """MindFormers: pad expert inputs to a fixed size (static shapes)."""


@dataclass
class ContextConfig:
    mode: int = 1
    """1 = eager (PyNative); the only supported mode."""
    device_target: Optional[str] = None
    """"Ascend" or "CPU"; by default Ascend when present, else CPU."""
    max_device_memory: Optional[str] = None
    """Cap on device memory, e.g. "58GB" (applied on Ascend; no effect on CPU)."""


@dataclass
class CompileConfig:
    enable: bool = True
    """Compile each decoder layer, MTP module and the head + loss with ms.jit (torchtitan's
    ``compile.enable``). false runs the whole model eager: no compile time at start-up (10-20 s
    per process on CPU), slower steps. Under tensor, expert or context parallelism the pieces
    between their collectives are compiled instead of whole layers. The graphs take the
    weights as inputs, so ZeRO-3 and pipeline stages run them on the weights they gather."""


@dataclass
class HealthCheckpointConfig:
    embedding_local_norm_threshold: float = 100.0
    """Say so when the embedding weight's norm on a rank exceeds this."""
    global_norm_skip_threshold: float = 100.0
    """Skip the update of a step whose global gradient norm exceeds this."""
    global_norm_skip_time: int = 10
    """Stop when this many consecutive steps were skipped for their norm."""


@dataclass
class TrainStateConfig:
    local_norm: Union[bool, str, list[str]] = ""
    """Per-parameter gradient norms on this rank: true for all, or name patterns."""
    local_loss: bool = False
    """Each rank's own loss (on its own step line)."""
    device_norm: Union[bool, str, list[str]] = False
    """Per-parameter gradient norms of the whole model (all ranks): true or name patterns."""
    device_loss: bool = False
    """The loss of each data-parallel rank, gathered on rank 0."""


@dataclass
class TensorboardConfig:
    output_dir: str = ""
    """Folder of the TensorBoard event files; empty disables TensorBoard.
    (alias: tensorboard_dir)"""
    log_interval: int = 1
    """Write scalars every this many steps."""
    queue_size: int = 1000
    """Events buffered before the writer flushes."""


@dataclass
class MoeMonitorConfig:
    save_tokens_per_expert_interval: Optional[int] = None
    """Log tokens routed to each expert every this many steps; null disables."""
    target_layers: Optional[Union[int, list[int]]] = None
    """Layers to report: the first N (an int) or these layer ids (a list)."""


@dataclass
class MonitorConfig:
    health_checkpoint: Optional[HealthCheckpointConfig] = None
    """Step skipping and weight health checks; absent = no checks (MindFormers' PyNative
    trainer does not act on it, and its static-graph trainer skips only when asked). Written
    in the config, even as ``{}``, it acts with MindFormers' defaults (100, 100, 10)."""
    train_state: TrainStateConfig = field(default_factory=TrainStateConfig)
    """Per-parameter norms and local/device losses in the log (true turns all on)."""
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)
    """TensorBoard event files."""
    moe_monitor: MoeMonitorConfig = field(default_factory=MoeMonitorConfig)
    """Expert load reporting."""
    metrics_dir: str = "./output/metrics"
    """Folder for the per-run JSON-lines metrics file."""
    hang_timeout: int = 600
    """Seconds a rank may go without finishing a step (from the end of the first step, which
    also compiles) before the job is ended as hung, naming the rank that fell behind and the
    step (mindtrain's; Megatron's --distributed-timeout-minutes is 10 min too). 0 turns the
    watch off."""


@dataclass
class ProfilerConfig:
    enable_profiling: bool = False
    """Run MindSpore's profiler over steps start_step..end_step."""
    start_step: int = 1
    """First profiled step."""
    end_step: int = 1
    """Last profiled step."""
    output_path: Optional[str] = None
    """Folder of the profiler output; by default <output_dir>/profile."""
    profiler_rank: Optional[list[int]] = None
    """Ranks that profile; null profiles every rank."""
    profiler_level: Optional[int] = 0
    """Detail level 0, 1 or 2."""
    mstx: bool = False
    """Collect lightweight mstx markers (Ascend)."""
    profile_memory: bool = False
    """Record tensor memory."""
    profile_cpu: bool = True
    """Record host (CPU) activity."""
    with_stack: bool = True
    """Record Python stacks."""


@dataclass
class RecomputeConfig:
    mode: str = "None"
    """Activation recompute: "None", "full" or "select"."""
    full_recompute_layer: Optional[Any] = None
    """Layers to recompute in full: a list of ids or ranges like "0-3"."""
    select_module: Optional[Any] = None
    """Module paths (and their layers) to recompute selectively."""
    exclude_op: Optional[list[str]] = None
    """Operator names whose outputs are kept instead of recomputed."""


@dataclass
class RecomputeCommConfig:
    enable: bool = False
    """Recompute the tensor/expert-parallel communication regions."""
    select_module: Optional[Any] = None
    """Communication modules (and layers) to recompute."""


@dataclass
class SwapConfig:
    enable: bool = False
    """Offload activations to host memory."""
    default_prefetch: int = 1
    """Operators to prefetch ahead of the backward pass."""
    layer_swap: Optional[Any] = None
    """Per-layer swap entries."""
    op_swap: Optional[Any] = None
    """Per-operator swap entries."""


@dataclass
class CallbackConfig:
    type: str = ""
    """Registered callback class name."""
    params: dict[str, Any] = field(default_factory=dict)
    """Every other key of the entry: keyword arguments of the callback."""


@dataclass
class LoraConfig:
    target_modules: str = ""
    """Regex of the Linear layers to adapt."""
    exclude_layers: Optional[str] = None
    """Regex of layers to leave alone."""
    lora_rank: int = 8
    """Adapter rank."""
    lora_alpha: int = 16
    """Scale numerator (scale = alpha / rank)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter input."""
    lora_a_std: float = 0.01
    """Init std of lora_a."""
    lora_b_std: float = 0.0
    """Init std of lora_b."""


@dataclass
class ValidationConfig:
    """Evaluation on held-out data during training (torchtitan's validator; MindFormers'
    PyNative trainer has none): the loss and perplexity of ``steps`` global batches every
    ``freq`` steps, in every layout, logged and written to TensorBoard."""

    enable: bool = False
    """Evaluate every ``freq`` steps."""
    freq: int = 100
    """Steps between evaluations (after steps freq, 2 x freq, ...)."""
    steps: int = 10
    """Global batches per evaluation (each the training's global_batch_size); -1 runs every
    sample of the eval data."""
    split: str = "valid"
    """The eval data when ``data_path`` is not set, in Megatron's names for the entries of
    train_dataset's split and sizes [train, valid, test] (MindFormers' comments call them
    [train, test, eval]): ``valid`` is the second entry, ``test`` the third."""
    data_path: Optional[list[str]] = None
    """Another dataset to evaluate on, as weight/prefix pairs like train_dataset's; all of its
    documents are eval data."""


@dataclass
class MindTrainConfig:
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    train_dataset: TrainDatasetConfig = field(default_factory=TrainDatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    recompute_comm: RecomputeCommConfig = field(default_factory=RecomputeCommConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    callbacks: list[CallbackConfig] = field(default_factory=list)
    lora_config: Optional[LoraConfig] = None
