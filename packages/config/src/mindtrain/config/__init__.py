"""The mindtrain YAML schema as dataclasses: loading, validation, legacy conversion."""

from mindtrain.config.__about__ import __version__

__all__ = ["__version__"]
