"""Parameter and FLOP counts from a ModelConfig alone (no model needed): those of the config's
parameter plan (:mod:`mindtrain.config.model_plan`, which the model builds exactly)."""

from __future__ import annotations

from mindtrain.config.model_plan import count_parameters, flops_per_token

__all__ = ["count_parameters", "flops_per_token"]
