"""Values computed from the config, in one place: parallel degrees, accumulation, warm-up."""

from __future__ import annotations

from dataclasses import dataclass

from mindtrain.config.errors import ConfigError
from mindtrain.config.schema import LRSchedulerConfig, MindTrainConfig, ParallelismConfig


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel degrees for one world size.

    The mesh is [pp, dp_shard, cp, tp] (outermost first); expert parallelism borrows its
    ranks from dp_shard x cp.
    """

    world_size: int
    pp: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @property
    def dp(self) -> int:
        """Ranks that see different samples."""
        return self.dp_shard

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1


def resolve_parallelism(p: ParallelismConfig, world_size: int) -> ParallelDims:
    """Fill in ``data_parallel_shard: -1`` and check that the degrees fit ``world_size``."""
    if world_size < 1:
        raise ConfigError("", f"world size must be >= 1, got {world_size}")
    tp, cp, pp, ep = p.tensor_parallel, p.context_parallel, p.pipeline_parallel, p.expert_parallel
    others = tp * cp * pp
    dp = p.data_parallel_shard
    if dp == -1:
        if world_size % others:
            raise ConfigError(
                "parallelism", f"tensor_parallel x context_parallel x pipeline_parallel = {others} "
                f"does not divide the {world_size} devices; change the degrees or the worker count")
        dp = world_size // others
    elif dp * others != world_size:
        raise ConfigError(
            "parallelism", f"data_parallel_shard x tensor_parallel x context_parallel x "
            f"pipeline_parallel = {dp}x{tp}x{cp}x{pp} = {dp * others}, but {world_size} devices "
            f"are running; make the product equal the worker count or set data_parallel_shard: -1")
    if (dp * cp) % ep:
        raise ConfigError(
            "parallelism.expert_parallel", f"{ep} must divide data_parallel_shard x "
            f"context_parallel = {dp}x{cp} = {dp * cp} (expert parallelism borrows those ranks)")
    return ParallelDims(world_size=world_size, pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep)


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
