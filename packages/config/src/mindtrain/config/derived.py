"""Values computed from the config, in one place: parallel degrees, accumulation, warm-up."""

from __future__ import annotations

from dataclasses import dataclass

from mindtrain.config.errors import ConfigError
from mindtrain.config.schema import LRSchedulerConfig, MindTrainConfig, ParallelismConfig


ZERO_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
"""``parallelism.data_parallel_shard_strategy`` values: ZeRO-1, ZeRO-2, ZeRO-3."""
ZERO3 = "optim_grads_params"

DEGREE_FIELDS = {"pp": "pipeline_parallel", "dp_shard": "data_parallel_shard", "cp": "context_parallel",
                 "tp": "tensor_parallel", "ep": "expert_parallel"}
"""ParallelDims attribute -> its ``parallelism`` field."""


def check_zero_strategy(strategy, path: str = "parallelism.data_parallel_shard_strategy") -> str:
    """``strategy`` if it names a ZeRO stage (see :data:`ZERO_STRATEGIES`)."""
    if strategy not in ZERO_STRATEGIES:
        raise ConfigError(path, f"must be one of {', '.join(ZERO_STRATEGIES)}, got {strategy!r}")
    return strategy


def check_degrees(p: ParallelismConfig) -> None:
    """Each degree is an integer >= 1 (``data_parallel_shard`` may also be -1)."""
    for field in DEGREE_FIELDS.values():
        v = getattr(p, field)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"parallelism.{field}", f"must be an integer, got {v!r}")
        if field == "data_parallel_shard" and v == -1:
            continue
        if v < 1:
            hint = " or -1 (use the remaining devices)" if field == "data_parallel_shard" else ""
            raise ConfigError(f"parallelism.{field}", f"must be a positive integer{hint}, got {v}")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees for one world size; checked when made (every degree >= 1,
    pp x dp_shard x cp x tp = world_size, ep divides dp_shard x cp).

    The mesh is [pp, dp_shard, cp, tp] (outermost first); expert parallelism borrows its
    ranks from dp_shard x cp.
    """

    world_size: int
    pp: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    dense_shard: int = 0
    """HSDP (``dense_fsdp_shard_size``): the dense weights' FSDP shard group size, a divisor of
    dp_shard; they are replicated over the dp_shard / dense_shard groups. 0 means dp_shard
    (plain FSDP)."""

    def __post_init__(self):
        if self.world_size < 1:
            raise ConfigError("", f"world size must be >= 1, got {self.world_size}")
        for attr, field in DEGREE_FIELDS.items():
            if getattr(self, attr) < 1:
                raise ConfigError(f"parallelism.{field}", f"must be a positive integer, got {getattr(self, attr)}")
        product = self.pp * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                "parallelism", f"data_parallel_shard x tensor_parallel x context_parallel x "
                f"pipeline_parallel = {self.dp_shard}x{self.tp}x{self.cp}x{self.pp} = {product}, but "
                f"{self.world_size} devices are running; make the product equal the worker count or set "
                f"data_parallel_shard: -1")
        if self.dense_shard and (self.dense_shard < 1 or self.dp_shard % self.dense_shard):
            raise ConfigError("parallelism.dense_fsdp_shard_size", f"{self.dense_shard} must divide data_parallel_shard "
                                                                   f"({self.dp_shard}): the dense weights are sharded "
                                                                   "within groups of that many ranks")
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                "parallelism.expert_parallel", f"{self.ep} must divide data_parallel_shard x "
                f"context_parallel = {self.dp_shard}x{self.cp} = {self.dp_shard * self.cp} (expert "
                f"parallelism borrows those ranks)")

    @property
    def dp(self) -> int:
        """Ranks that see different samples."""
        return self.dp_shard

    @property
    def dense_shard_size(self) -> int:
        """Ranks the dense weights are sharded over (``dp_shard`` without HSDP)."""
        return self.dense_shard or self.dp_shard

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1


def resolve_parallelism(p: ParallelismConfig, world_size: int) -> ParallelDims:
    """Fill in ``data_parallel_shard: -1`` and check that the degrees fit ``world_size``."""
    if world_size < 1:
        raise ConfigError("", f"world size must be >= 1, got {world_size}")
    check_degrees(p)
    tp, cp, pp, ep = p.tensor_parallel, p.context_parallel, p.pipeline_parallel, p.expert_parallel
    others = tp * cp * pp
    dp = p.data_parallel_shard
    if dp == -1:
        if world_size % others:
            raise ConfigError(
                "parallelism", f"tensor_parallel x context_parallel x pipeline_parallel = {others} "
                f"does not divide the {world_size} devices; change the degrees or the worker count")
        dp = world_size // others
    dense = p.dense_fsdp_shard_size
    if dense is not None and (not isinstance(dense, int) or isinstance(dense, bool) or dense < 1):
        raise ConfigError("parallelism.dense_fsdp_shard_size", f"must be a positive integer or null, got {dense!r}")
    return ParallelDims(world_size=world_size, pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep,
                        dense_shard=0 if dense is None or dense == dp else dense)


def num_accumulation_steps(cfg: MindTrainConfig, dims: ParallelDims) -> int:
    """global_batch_size / (data_parallel_shard x local_batch_size), a positive integer."""
    t = cfg.training
    per_step = dims.dp * t.local_batch_size
    if t.global_batch_size % per_step or t.global_batch_size < per_step:
        raise ConfigError(
            "training.global_batch_size", f"{t.global_batch_size} must be a positive multiple of "
            f"data_parallel_shard x local_batch_size = {dims.dp}x{t.local_batch_size} = {per_step}")
    return t.global_batch_size // per_step


def total_lr_steps(cfg: MindTrainConfig) -> int:
    """Length of the LR schedule: lr_scheduler.total_steps, else training.steps."""
    return cfg.lr_scheduler.total_steps or cfg.training.steps


def warmup_steps(lr: LRSchedulerConfig, total_steps: int) -> int:
    """warmup_steps if set, else int(warmup_ratio x total_steps)."""
    if lr.warmup_steps is not None:
        return lr.warmup_steps
    return int(lr.warmup_ratio * total_steps)
