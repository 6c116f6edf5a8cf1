"""Micro-batches for one data-parallel rank, in Megatron's pretraining-sampler order."""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from mindtrain.config import ConfigError, TrainDatasetConfig, from_dict


def collate(samples: list) -> dict:
    """Stack a list of sample dicts column by column."""
    return {k: np.stack([s[k] for s in samples]) for k in samples[0]}


class PretrainingLoader:
    """Iterates micro-batches ``{column: array[micro_batch_size, ...]}`` for rank ``dp_rank``.

    Samples are taken in consecutive global batches of ``global_batch_size``; each global
    batch is cut into groups of ``micro_batch_size * dp_size`` and rank r takes slice
    ``[r*mbs, (r+1)*mbs)`` of every group (Megatron's MegatronPretrainingSampler). So each
    step gives every rank ``global_batch_size / (micro_batch_size * dp_size)`` micro-batches.

    ``shuffle`` permutes the sample order of each epoch with ``RandomState(seed + epoch)``;
    ``repeat`` (default) starts another epoch at the end, else iteration stops there;
    ``num_workers`` threads prefetch. ``state_dict()`` records the next sample;
    ``load_state_dict()`` resumes there in O(1). A state of only ``{"consumed_samples": n}``
    counts n samples over all epochs (Megatron's consumed_samples).
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, drop_remainder: bool = True, num_workers: int = 0,
                 shuffle: bool = False, seed: int = 0, start_step: int = 0, repeat: bool = True):
        if micro_batch_size < 1 or dp_size < 1:
            raise ConfigError("training.local_batch_size", f"micro batch {micro_batch_size} and dp size {dp_size} must be >= 1")
        group = micro_batch_size * dp_size
        if global_batch_size < group or global_batch_size % group:
            raise ConfigError("training.global_batch_size",
                              f"{global_batch_size} must be a positive multiple of local_batch_size x "
                              f"data-parallel size = {micro_batch_size} x {dp_size} = {group}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.drop_remainder = drop_remainder
        self.num_workers = max(0, int(num_workers))
        self.shuffle, self.seed, self.repeat = bool(shuffle), int(seed), bool(repeat)
        self.num_samples = len(dataset)
        self.micro_batches_per_step = global_batch_size // group
        self.steps_per_epoch = (self.num_samples // global_batch_size if drop_remainder
                                else -(-self.num_samples // global_batch_size))
        self._epoch_end = (self.steps_per_epoch * global_batch_size if drop_remainder else self.num_samples)
        if self.steps_per_epoch == 0:
            raise ConfigError("train_dataset.dataloader.sizes",
                              f"the dataset has {self.num_samples} samples, fewer than one global batch "
                              f"of {global_batch_size}; add data or raise sizes")
        self._order_epoch, self._order = None, None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: collections.deque = collections.deque()
        self._epoch, self._consumed = 0, 0
        self._set_position(start_step * global_batch_size)

    # -- position ---------------------------------------------------------------------------
    def _set_position(self, consumed_total: int, epoch: Optional[int] = None) -> None:
        if epoch is None:
            epoch, consumed_total = divmod(consumed_total, self._epoch_end)
            if epoch and not self.repeat:
                epoch, consumed_total = 0, self._epoch_end  # past the end: nothing left
        self._epoch, self._consumed = epoch, consumed_total
        self._next_epoch, self._next_consumed = epoch, consumed_total
        self._drop_pending()

    def state_dict(self) -> dict:
        """Where the next micro-batch starts: epoch and samples consumed (all ranks) in it."""
        return {"epoch": self._epoch, "consumed_samples": self._consumed, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples", self.num_samples) != self.num_samples:
            raise ConfigError("train_dataset", f"the checkpoint's data position is for {state['num_samples']} "
                              f"samples but the dataset now has {self.num_samples}; resume with the same data settings")
        if (state.get("shuffle", self.shuffle), state.get("seed", self.seed)) != (self.shuffle, self.seed):
            raise ConfigError("train_dataset.dataloader.shuffle",
                              "differs from the checkpoint (shuffle/seed); resume with the same settings")
        epoch = state.get("epoch")
        self._set_position(int(state["consumed_samples"]), None if epoch is None else int(epoch))

    def __len__(self) -> int:
        """Micro-batches this rank gets per epoch."""
        return self.steps_per_epoch * self.micro_batches_per_step

    # -- reading ----------------------------------------------------------------------------
    def _indices(self, epoch: int, start: int) -> list:
        lo = start + self.dp_rank * self.micro_batch_size
        hi = min(lo + self.micro_batch_size, self._epoch_end)
        if lo >= hi:
            return []
        if not self.shuffle:
            return list(range(lo, hi))
        if self._order_epoch != epoch:
            self._order = np.random.RandomState(self.seed + epoch).permutation(self.num_samples)
            self._order_epoch = epoch
        return [int(i) for i in self._order[lo:hi]]

    def _plan_next(self):
        """(epoch, start, indices) of the next micro-batch, advancing the planning cursor."""
        group = self.micro_batch_size * self.dp_size
        while True:
            if self._next_consumed >= self._epoch_end:
                if not self.repeat:
                    return None
                self._next_epoch, self._next_consumed = self._next_epoch + 1, 0
            epoch, start = self._next_epoch, self._next_consumed
            self._next_consumed += group
            idx = self._indices(epoch, start)
            if idx:  # only a final partial group (drop_remainder off) can be empty for a rank
                return epoch, start + group, idx

    def _load(self, idx: list) -> dict:
        return collate([self.dataset[i] for i in idx])

    def _drop_pending(self) -> None:
        for _, _, fut in self._pending:
            fut.cancel()
        self._pending.clear()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.num_workers == 0:
            plan = self._plan_next()
            if plan is None:
                raise StopIteration
            epoch, consumed, idx = plan
            batch = self._load(idx)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="mindtrain-data")
            while len(self._pending) < 2 * self.num_workers:
                plan = self._plan_next()
                if plan is None:
                    break
                epoch, consumed, idx = plan
                self._pending.append((epoch, consumed, self._pool.submit(self._load, idx)))
            if not self._pending:
                raise StopIteration
            epoch, consumed, fut = self._pending.popleft()
            batch = fut.result()
        self._epoch, self._consumed = epoch, consumed
        return batch

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def build_loader(train_dataset_section, dataset, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, start_step: int = 0,
                 repeat: bool = True) -> PretrainingLoader:
    """A PretrainingLoader with drop_remainder, num_parallel_workers and shuffle from the section."""
    section = (train_dataset_section if isinstance(train_dataset_section, TrainDatasetConfig)
               else from_dict(TrainDatasetConfig, train_dataset_section, "train_dataset"))
    return PretrainingLoader(dataset, micro_batch_size, global_batch_size, dp_rank, dp_size,
                             drop_remainder=section.drop_remainder,
                             num_workers=section.num_parallel_workers,
                             shuffle=section.dataloader.shuffle, seed=seed, start_step=start_step,
                             repeat=repeat)
