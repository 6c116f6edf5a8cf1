"""Model registry: (model_type, architectures) -> model class.

Imports no model: the package's ``__init__`` registers the built-in ones, so that a model
module may build through the registry (e.g. ``from_pretrained``) without an import circle."""

from __future__ import annotations

from typing import Any, Optional

from mindtrain.config import ConfigError, ModelConfig, validate_model
from mindtrain.models.weights import empty_weights, materialize

_MODELS: dict[tuple[str, str], type] = {}

# ms.jit per decoder layer is the default: it passes the same parity tests as eager and is
# 5-7x faster on CPU (see the package README).
DEFAULT_JIT = True


def register_model(model_type: str, architecture: str, cls: type) -> None:
    _MODELS[(model_type, architecture)] = cls


def model_class(model_type: str, architecture: str) -> type:
    try:
        return _MODELS[(model_type, architecture)]
    except KeyError:
        known = ", ".join(f"{t}/{a}" for t, a in sorted(_MODELS))
        raise ConfigError("model.model_type", f"no model registered for {model_type}/{architecture}; "
                          f"known: {known}") from None


def build_model(model_cfg: ModelConfig, jit: Optional[bool] = None, compute_dtype: Optional[str] = None,
                recompute: Any = None, empty: bool = False, seed: Optional[int] = None, **kwargs: Any):
    """Validate ``model_cfg`` and build its model: float32 parameters with their first values
    from ``seed`` (default: ms.set_seed's; :mod:`mindtrain.models.weights`), or with
    ``empty`` none at all (no memory; a layout gives each rank's pieces their values from
    :func:`mindtrain.models.initial_values` or a checkpoint). ``jit`` None means DEFAULT_JIT. ``compute_dtype`` ("float32",
    "float16", "bfloat16") is the matmul dtype; None means ``model_cfg.compute_dtype`` after
    :func:`mindtrain.models.effective_compute_dtype` for the current device (bfloat16 on CPU
    runs as float32); an explicit dtype the device lacks raises ConfigError. ``recompute``
    (the config's ``recompute`` section, or a ``RecomputePlan``) sets activation recompute
    (:func:`mindtrain.models.execution.apply_recompute`)."""
    validate_model(model_cfg)
    cls = model_class(model_cfg.model_type, model_cfg.architectures)
    from mindtrain.models.execution import apply_compile, apply_recompute

    with empty_weights():
        model = cls(model_cfg, compute_dtype=compute_dtype, **kwargs)
    if not empty:
        materialize(model, seed)
    if DEFAULT_JIT if jit is None else jit:
        apply_compile(model)
    if recompute is not None:
        apply_recompute(model, recompute)
    return model
