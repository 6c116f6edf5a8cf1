"""Evaluation on held-out data during training (the ``validation`` section).

Every ``validation.freq`` steps the layout runs forward only (:meth:`Layout.evaluate`) on
``validation.steps`` global batches of the eval data, the same ones each time: the split
``validation.split`` of train_dataset (Megatron's valid or test documents) or the dataset at
``validation.data_path``. Each data-parallel rank reads its share of every global batch as in
training, so the figure is the mean of the global batches' mean losses: what one process
computes over the same batches with the same weights, in every layout.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import numpy as np

from mindtrain.config import MindTrainConfig, StepFigures


def eval_dataset(cfg: MindTrainConfig):
    """The eval dataset the ``validation`` section names (``steps`` global batches of it, or
    all of it with ``steps: -1``)."""
    from mindtrain.data import build_dataset

    v = cfg.validation
    gbs = cfg.training.global_batch_size
    wanted = v.steps * gbs if v.steps > 0 else None
    section = cfg.train_dataset
    if v.data_path is not None:
        section = copy.deepcopy(section)
        section.dataloader.config.data_path = list(v.data_path)
        section.dataloader.config.split = "1, 0, 0"
        section.dataloader.sizes = [wanted, 0, 0] if wanted is not None else None
        return build_dataset(section, "train", num_samples=wanted)
    if wanted is None:
        sizes = section.dataloader.sizes
        index = 1 if v.split == "valid" else 2
        wanted = sizes[index] if sizes is not None and len(sizes) > index and sizes[index] else None
    return build_dataset(section, v.split, num_samples=wanted)


class Validator:
    """Runs the evaluation of one rank: ``run(layout)`` -> the figures of all ranks."""

    def __init__(self, cfg: MindTrainConfig, dp_rank: int, dp_size: int,
                 all_sum: Callable[[np.ndarray], np.ndarray], world_size: int):
        self.cfg = cfg
        self.freq = cfg.validation.freq
        self.steps = cfg.validation.steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.all_sum = all_sum
        self.world_size = world_size
        self.dataset = eval_dataset(cfg)

    @classmethod
    def from_config(cls, cfg: MindTrainConfig, dp_rank: int, dp_size: int,
                    all_sum: Callable[[np.ndarray], np.ndarray], world_size: int) -> Optional["Validator"]:
        return cls(cfg, dp_rank, dp_size, all_sum, world_size) if cfg.validation.enable else None

    def due(self, step: int) -> bool:
        return step % self.freq == 0

    def _loader(self):
        from mindtrain.data import PretrainingLoader

        t = self.cfg.training
        return PretrainingLoader(self.dataset, micro_batch_size=t.local_batch_size, global_batch_size=t.global_batch_size,
                                 dp_rank=self.dp_rank, dp_size=self.dp_size, drop_remainder=True, repeat=False)

    def run(self, layout) -> dict:
        """Evaluate the eval data's first ``steps`` global batches (all with -1) through
        ``layout``; returns ``validation_loss`` (mean LM loss), ``validation_ppl`` (its exp)
        and ``validation_samples`` (global), the same on every rank."""
        loader = self._loader()
        per_step = loader.micro_batches_per_step
        batches = iter(loader)
        n_global = loader.steps_per_epoch if self.steps < 0 else min(self.steps, loader.steps_per_epoch)
        figures = []
        for _ in range(n_global):
            figures.extend(layout.evaluate([next(batches) for _ in range(per_step)]))
        local = np.mean(np.array(figures, np.float64), axis=0)
        mean = StepFigures(*(self.all_sum(local) / self.world_size))
        loss = float(mean.lm_loss)
        return {"validation_loss": loss, "validation_ppl": math.exp(min(loss, 700.0)),
                "validation_samples": n_global * self.cfg.training.global_batch_size}


def format_validation_line(step: int, total: int, rec: dict) -> str:
    """``validation: { step:[    5/   10], loss:   6.123456, perplexity: 456.789100, samples: 8 }``
    (the step line's shape, so it greps apart from it)."""
    return (f"validation: {{ step:[{step:5d}/{total:5d}], loss: {rec['validation_loss']:10.6f}, "
            f"perplexity: {rec['validation_ppl']:.6f}, samples: {rec['validation_samples']} }}")
