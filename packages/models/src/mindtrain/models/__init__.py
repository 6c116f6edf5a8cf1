"""DeepSeek-V3 (MLA, MoE, MTP) for MindSpore eager mode, with HF weight names."""

from mindtrain.models.__about__ import __version__

__all__ = ["__version__"]
