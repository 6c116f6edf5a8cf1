"""The YAML schema: one dataclass per section, field names as in the quick start.

Each field carries its documentation as an attribute docstring. Defaults are the quick
start's. ``None`` marks a value that has no safe default and must be given where it is
used (the validator says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class CheckpointConfig:
    enable_save: bool = False
    """Write safetensors checkpoints under ``save_path``."""
    save_path: str = "./output/ds3"
    """Folder that receives one sub-folder per saved step and the tracker file."""
    save_interval: int = 0
    """Save every this many steps; 0 saves only at the end of training."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints; 0 keeps all."""
    load_path: str = ""
    """Resume from this checkpoint folder (or the folder holding the tracker file), or
    start from the weights of a Hugging Face model directory (one with config.json)."""
    load_optimizer: bool = True
    """When resuming, also restore optimizer, scheduler, data position and RNG state."""


@dataclass
class TrainingConfig:
    steps: int = 10
    """Number of optimizer steps."""
    local_batch_size: int = 1
    """Samples per device per forward pass (micro-batch size)."""
    global_batch_size: int = 2
    """Samples per optimizer step over all data-parallel ranks, including accumulation."""
    max_norm: float = 1.0
    """Clip gradients to this global L2 norm; <= 0 disables clipping."""
    seed: int = 42
    """Seed for parameter initialisation and every other random draw."""
    log_interval: int = 1
    """Print the step line every this many steps."""
    max_skipped_steps: int = 5
    """Stop when this many consecutive steps have a non-finite loss or gradient."""


@dataclass
class ParallelismConfig:
    data_parallel_shard: int = -1
    """FSDP degree; -1 takes all devices that the other degrees leave."""
    expert_parallel: int = 1
    """Expert-parallel degree; borrows ranks from data_parallel_shard x context_parallel."""
    tensor_parallel: int = 1
    """Tensor-parallel degree; sequence parallelism is always on when this is > 1."""
    context_parallel: int = 1
    """Context-parallel degree (sequence split over ranks)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel degree (number of stages)."""
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """What FSDP shards: "optim" (optimizer state), "optim_grads", or
    "optim_grads_params" (ZeRO-3, the default)."""
    pipeline_schedule: str = "1f1b"
    """Pipeline schedule: "1f1b" or "gpipe"."""
    pipeline_layers_per_stage: Optional[list[int]] = None
    """Decoder layers on each stage; by default layers are balanced by count."""


@dataclass
class OptimizerConfig:
    type: str = "AdamW"
    """Optimizer; "AdamW" (decoupled weight decay, no decay on norms and biases)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1.0e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""


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
    """The dataset's settings. Required."""


@dataclass
class TrainDatasetConfig:
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    """How samples are built and batched."""
    drop_remainder: bool = True
    """Drop a last global batch that is not full."""
    num_parallel_workers: int = 8
    """Background threads that prefetch batches."""


@dataclass
class ModelConfig:
    model_type: str = "deepseek_v3"
    """Registry key of the model family."""
    architectures: str = "DeepseekV3ForCausalLM"
    """Model class (a string, not a list)."""
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
    """The first this many layers use a dense MLP instead of MoE."""
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    initializer_range: float = 0.02
    rms_norm_eps: float = 1.0e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    """YaRN settings: {type: yarn, factor, original_max_position_embeddings, beta_fast,
    beta_slow, mscale, mscale_all_dim}."""
    rope_interleave: bool = True
    """The checkpoint stores rope dims interleaved (as DeepSeek-V3 does)."""
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
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
    """Master weight dtype (parameters, gradients, optimizer state); float32."""


@dataclass
class ContextConfig:
    mode: int = 1
    """1 = eager (PyNative); the only supported mode."""
    device_target: Optional[str] = None
    """"Ascend" or "CPU"; by default Ascend when present, else CPU."""
    max_device_memory: Optional[str] = None
    """Cap on device memory, e.g. "58GB" (Ascend)."""


@dataclass
class MonitorConfig:
    train_state: bool = False
    """Log per-parameter norms and local/device-level loss every log step."""
    metrics_dir: str = "./output/metrics"
    """Folder for the per-run JSON-lines metrics file."""


@dataclass
class MindTrainConfig:
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    train_dataset: TrainDatasetConfig = field(default_factory=TrainDatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
