"""The train_dataset section -> a GPT or blended dataset, as Megatron's BlendedMegatronDatasetBuilder."""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

import numpy as np

from mindtrain.config import (ConfigError, DataLoaderConfig, GPTDatasetConfig, TrainDatasetConfig,
                              from_dict, parse_data_path, split_weights)
from mindtrain.data.blended_dataset import BlendedDataset, normalize
from mindtrain.data.gpt_dataset import GPTDataset, index_cache_dir
from mindtrain.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")
MID_LEVEL_SURPLUS = 0.005
_CPATH = "train_dataset.dataloader.config"


def split_matrix(split: str) -> list:
    """'98,1,1' -> [(0, .98), (.98, .99), (.99, 1.0)], None for an empty split (Megatron's rule;
    the grammar is mindtrain.config.split_weights, the one the config validation uses)."""
    vector = normalize(split_weights(split, f"{_CPATH}.split"))
    bounds = functools.reduce(lambda a, b: a + [a[-1] + b], [[0], *vector])
    return [None if hi <= lo else (lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_documents(num_sequences: int, bookends) -> np.ndarray:
    beg = int(round(bookends[0] * float(num_sequences)))
    end = int(round(bookends[1] * float(num_sequences)))
    return np.arange(beg, end, dtype=np.int32)


def sizes_per_dataset(weights: list, sizes: list, surplus: float = 0.0) -> list:
    """Samples each member contributes per split: ceil(ceil(size * w) * (1 + surplus))."""
    return [[int(math.ceil(math.ceil(size * w) * (1 + surplus))) for size in sizes] for w in weights]


def _section(section) -> TrainDatasetConfig:
    if isinstance(section, TrainDatasetConfig):
        return section
    if isinstance(section, DataLoaderConfig):
        return TrainDatasetConfig(dataloader=section)
    if isinstance(section, dict):
        return from_dict(TrainDatasetConfig, section, "train_dataset")
    raise TypeError(f"expected the train_dataset section (dict or TrainDatasetConfig), got {type(section).__name__}")


def build_dataset(train_dataset_section: Union[dict, TrainDatasetConfig], split: str = "train",
                  num_samples: Optional[int] = None):
    """The dataset of one split ("train", "valid", "test") of the train_dataset section.

    ``num_samples`` overrides that split's entry of ``sizes``. A single data_path prefix
    without a weight gives a GPTDataset; weighted prefixes give a BlendedDataset whose members
    are built with Megatron's 0.5% surplus.
    """
    section = _section(train_dataset_section)
    dl = section.dataloader
    if dl.datasets_type not in (None, "GPTDataset"):
        raise ConfigError("train_dataset.dataloader.datasets_type", f"must be \"GPTDataset\", got {dl.datasets_type!r}")
    c: Optional[GPTDatasetConfig] = dl.config
    if c is None:
        raise ConfigError(_CPATH, "is required (seq_length, split, eod, pad, data_path, ...)")
    if not c.data_path:
        raise ConfigError(f"{_CPATH}.data_path", "is empty; give weight/prefix pairs, e.g. ['1', './data/corpus_text_document']")
    if c.split is None:
        raise ConfigError(f"{_CPATH}.split", "required when data_path is set, e.g. \"1, 0, 0\"")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if c.create_attention_mask and c.create_compressed_eod_mask:
        raise ConfigError(f"{_CPATH}.create_compressed_eod_mask",
                          "cannot be combined with create_attention_mask; choose one attention_mask form")
    wants_mask = c.create_attention_mask or c.create_compressed_eod_mask
    if len(dl.column_names) != 4 + wants_mask:
        raise ConfigError("train_dataset.dataloader.column_names",
                          f"needs {4 + wants_mask} names ({'with' if wants_mask else 'without'} attention_mask), got {dl.column_names}")
    s = SPLITS.index(split)
    sizes = list(dl.sizes) if dl.sizes is not None else [None, None, None]
    if num_samples is not None:
        sizes[s] = int(num_samples)
    matrix = split_matrix(c.split)
    if matrix[s] is None:
        raise ConfigError(f"{_CPATH}.split", f"{c.split!r} gives no documents to the {split} split")
    prefixes, _ = parse_data_path(list(c.data_path), f"{_CPATH}.data_path")
    weights = None if len(c.data_path) == 1 else [float(c.data_path[i]) for i in range(0, len(c.data_path), 2)]

    def member(prefix: str, n: Optional[int]) -> GPTDataset:
        indexed = IndexedDataset(prefix, mmap=c.mmap_bin_files)
        docs = split_documents(len(indexed), matrix[s])
        return GPTDataset(indexed, docs, n, c, split, dl.column_names)

    if weights is None:
        return member(prefixes[0], sizes[s])
    if sizes[s] is None:
        raise ConfigError("train_dataset.dataloader.sizes", "weighted data_path needs a sample count for the split")
    weights = normalize(weights)
    target = sizes_per_dataset(weights, sizes)
    buffered = sizes_per_dataset(weights, sizes, MID_LEVEL_SURPLUS)
    members = [member(p, buffered[i][s]) for i, p in enumerate(prefixes)]
    size = sum(target[i][s] for i in range(len(prefixes)))
    cache_dir = index_cache_dir(prefixes[0], c.path_to_cache, "BlendedDataset")
    return BlendedDataset(members, weights, size, cache_dir)
