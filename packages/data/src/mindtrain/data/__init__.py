"""Megatron-compatible indexed datasets, GPT and blended datasets, loader and preprocessing (numpy only)."""

from mindtrain.data.__about__ import __version__

__all__ = ["__version__"]
