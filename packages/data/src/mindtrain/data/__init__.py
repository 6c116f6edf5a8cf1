"""Megatron-compatible indexed datasets, GPT and blended datasets, loader and preprocessing (numpy only)."""

from mindtrain.data.__about__ import __version__
from mindtrain.data.blended_dataset import BlendedDataset
from mindtrain.data.dataset_builder import build_dataset
from mindtrain.data.errors import DataFileError
from mindtrain.data.gpt_dataset import GPTDataset, compressed_eod_mask, ltor_masks_and_position_ids
from mindtrain.data.indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype

__all__ = [
    "__version__", "BlendedDataset", "DataFileError", "GPTDataset", "IndexedDataset",
    "IndexedDatasetBuilder", "build_dataset", "compressed_eod_mask", "ltor_masks_and_position_ids",
    "optimal_dtype",
]
