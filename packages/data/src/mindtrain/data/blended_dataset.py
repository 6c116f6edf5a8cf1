"""Mixing several GPT datasets by weight, in Megatron-Core's greedy order."""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

from mindtrain.data.errors import UserError
from mindtrain.data.index_cache import cached_build


def normalize(weights) -> list:
    """Megatron's normalisation (float64 numpy division), kept bit-exact."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def build_blending_indices(weights: list, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of length ``size``.

    Sample s goes to the dataset with the largest error w_d * max(s, 1) - taken_d (first on
    ties), computed in float64 like Megatron's C++ helper.
    """
    n = len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    w = [float(x) for x in weights]
    taken = [0] * n
    if n == 1:
        dataset_sample_index[:] = np.arange(size, dtype=np.int64)
        return dataset_index, dataset_sample_index
    if n == 2:
        w0, w1 = w
        t0 = t1 = 0
        choice = bytearray(size)
        for s in range(size):
            x = float(s) if s > 1 else 1.0
            if w1 * x - t1 > w0 * x - t0:
                choice[s] = 1
                t1 += 1
            else:
                t0 += 1
        sel = np.frombuffer(bytes(choice), dtype=np.uint8).astype(bool)
        dataset_index[sel] = 1
        dataset_sample_index[~sel] = np.arange(t0, dtype=np.int64)
        dataset_sample_index[sel] = np.arange(t1, dtype=np.int64)
        return dataset_index, dataset_sample_index
    rng = range(1, n)
    for s in range(size):
        x = float(s) if s > 1 else 1.0
        best, best_err = 0, w[0] * x - taken[0]
        for d in rng:
            err = w[d] * x - taken[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[s] = best
        dataset_sample_index[s] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples of member datasets interleaved by normalised weights, ``size`` in total."""

    def __init__(self, datasets: list, weights: list, size: int, cache_dir: Optional[str] = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("one weight per dataset is needed")
        if len(datasets) >= 32767:
            raise UserError("train_dataset.dataloader.config.data_path: at most 32766 datasets can be blended")
        self.datasets = datasets
        self.weights = normalize(weights)
        self.size = int(size)
        self.column_names = datasets[0].column_names
        # The interleaving depends on nothing but the weights and the size.
        desc = json.dumps({"class": "BlendedDataset", "weights": self.weights, "size": self.size}, indent=2)
        arrays, self.built_indices = cached_build(
            cache_dir, desc, "BlendedDataset", ["dataset_index", "dataset_sample_index"],
            lambda: dict(zip(["dataset_index", "dataset_sample_index"],
                             build_blending_indices(self.weights, self.size))))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(datasets))
        for d, (count, ds) in enumerate(zip(counts, datasets)):
            if count > len(ds):
                raise UserError(f"train_dataset.dataloader.config.data_path: the blend takes {int(count)} "
                                f"samples from dataset {d} ({ds.indexed.path_prefix}) which has only "
                                f"{len(ds)}; lower sizes or raise that dataset's weight")

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def source(self, idx: int) -> tuple[int, int]:
        """(member dataset, sample in it) of blended sample ``idx``."""
        return int(self.dataset_index[idx]), int(self.dataset_sample_index[idx])

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        d, s = self.source(idx)
        return self.datasets[d][s]
