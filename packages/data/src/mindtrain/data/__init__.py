"""Megatron-compatible indexed datasets, GPT and blended datasets, loader and preprocessing (numpy only)."""

from mindtrain.data.__about__ import __version__
from mindtrain.data.blended_dataset import BlendedDataset
from mindtrain.data.dataset_builder import build_dataset
from mindtrain.data.errors import DataFileError
from mindtrain.data.gpt_dataset import GPTDataset, compressed_eod_mask, ltor_masks_and_position_ids
from mindtrain.data.indexed import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from mindtrain.data.loader import PretrainingLoader, build_loader, collate
from mindtrain.data.preprocess import preprocess
from mindtrain.data.token_ids import check_token_ids
from mindtrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "__version__", "BlendedDataset", "ByteTokenizer", "DataFileError", "GPTDataset", "HFTokenizer",
    "IndexedDataset", "IndexedDatasetBuilder", "PretrainingLoader", "build_dataset", "build_loader",
    "check_token_ids", "collate", "compressed_eod_mask", "load_tokenizer", "ltor_masks_and_position_ids",
    "optimal_dtype", "preprocess",
]
