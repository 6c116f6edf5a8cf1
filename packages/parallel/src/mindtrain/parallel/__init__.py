"""Device mesh, portable collectives, FSDP, TP+SP, EP, CP and PP for MindSpore."""

from mindtrain.parallel.__about__ import __version__

__all__ = ["__version__"]
