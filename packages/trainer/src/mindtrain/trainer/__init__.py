"""The mindtrain Trainer and the run_mindformer.py entry point."""

from mindtrain.trainer.__about__ import __version__

__all__ = ["__version__"]
