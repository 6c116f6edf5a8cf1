"""Which Linear layers ``lora_config`` adapts, and the adapters' shapes: the rules
:mod:`mindtrain.trainer.lora` applies to the model and ``mindtrain-estimate`` counts from the
parameter plan (plain Python: the estimator runs without numpy or MindSpore)."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from mindtrain.trainer.mindformers_name_table import fused_first, locate


def mindformers_path(weight_name: str, model_cfg: Any) -> Optional[str]:
    """MindFormers' PyNative cell path of the layer holding mindtrain's ``weight_name``; None
    when MindFormers holds it as a bare parameter, not a layer's weight (DeepSeek-V4's grouped
    output projection ``linear_o_group_proj``: MindFormers' walk never sees it)."""
    theirs, _ = locate(weight_name, model_cfg)
    return "model." + theirs[:-len(".weight")] if theirs.endswith(".weight") else None


def excluded(path: str, exclude: Optional[re.Pattern]) -> bool:
    """Whether ``exclude`` matches ``path`` or a cell above it (MindFormers skips the cell and
    everything below it)."""
    if exclude is None:
        return False
    parts = path.split(".")
    return any(exclude.search(".".join(parts[:i])) for i in range(1, len(parts) + 1))


def select_layers(weight_names: Sequence[str], cfg: Any) -> list[str]:
    """The weights (of Linear layers, by name) whose layers ``cfg.lora_config`` adapts."""
    lc = cfg.lora_config
    target = re.compile(lc.target_modules)
    exclude = re.compile(lc.exclude_layers) if lc.exclude_layers else None
    out = []
    for name in weight_names:
        path = mindformers_path(name, cfg.model)
        if path is not None and target.search(path) and not excluded(path, exclude):
            out.append(name)
    return out


# 2-D ``.weight`` parameters of the plan that are not Linear layers' weights: the embedding, a
# MoE block's router (routed experts are stacked, 3-D)
_NOT_LINEAR = re.compile(r"^model\.embed_tokens\.weight$|\.mlp\.gate\.weight$")


def linear_weights(specs: Sequence[Any]) -> list[str]:
    """The Linear layers' weights among the parameter plan's ``specs``
    (:func:`mindtrain.config.model_plan.param_specs`): the 2-D ``.weight`` parameters outside
    the routed experts, save the embedding and the routers."""
    return [p.name for p in specs if len(p.shape) == 2 and not p.expert and p.name.endswith(".weight")
            and not _NOT_LINEAR.search(p.name)]


def adapter_shapes(specs: Sequence[Any], cfg: Any) -> list[tuple[str, str, tuple[int, int]]]:
    """``(adapter name, its weight's name, shape)`` of every adapter ``cfg.lora_config`` gives the
    plan's ``specs``, as :func:`mindtrain.trainer.lora.apply_lora` makes them: ``<layer>.lora_a``
    [r, in] (only on an unfused layer or the first part of a fused one: the other parts share
    it) and ``<layer>.lora_b`` [out, r]."""
    r = cfg.lora_config.lora_rank
    shapes = {p.name: tuple(p.shape) for p in specs}
    out = []
    for name in select_layers(linear_weights(specs), cfg):
        out_f, in_f = shapes[name]
        layer = name[:-len(".weight")]
        if fused_first(locate(name, cfg.model)[1]):
            out.append((layer + ".lora_a", name, (r, in_f)))
        out.append((layer + ".lora_b", name, (out_f, r)))
    return out


__all__ = ["adapter_shapes", "excluded", "linear_weights", "mindformers_path", "select_layers"]
