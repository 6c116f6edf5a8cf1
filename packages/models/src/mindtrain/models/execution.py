"""How a model runs: compiled pieces and activation recompute, applied to a built model.

The model classes hold the math (:mod:`mindtrain.models.blocks`: pieces are functions of
the weights they are given); this module decides how they run, torchtitan's
``apply_compile`` / ``apply_ac`` split:

- :func:`apply_compile` gives every piece of every :class:`~mindtrain.models.blocks.Block`
  an ``ms.jit`` form, one graph per kind of cell (layers whose constants are equal share it;
  :class:`~mindtrain.models.blocks.GraphCache`). A decoder layer (or MTP module) runs as one graph while nothing
  inside it is wrapped by a layout (tensor, expert or context parallelism put collectives
  inside a layer); otherwise its sub-cells' pieces run as graphs between the layout's
  Python code ("regions"). The choice is made at each call, so the order in which a
  layout and this function are applied does not matter. Weights are graph inputs: a
  ZeRO-3 unit that gathers a layer's weights into its Parameters (``set_data``) runs the
  same graphs.
- :func:`apply_recompute` recomputes whole layers (``full``) or sub-modules (``select``).

Call order does not matter between the two; both may be called once per model.
"""

from __future__ import annotations

import re
from typing import Any

from mindspore import nn

from mindtrain.config import ConfigError, RecomputePlan, module_matches, recompute_plan
from mindtrain.config.recompute import core_in_row_blocks
from mindtrain.models.blocks import Block, GraphCache
from mindtrain.models.recompute import Recompute, recompute_submodule

GRANULARITIES = ("auto", "region")


def _ranges(ids) -> str:
    ids = sorted(ids)
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def _layers(model: nn.Cell) -> list:
    return list(model.model.layers)


def apply_compile(model: nn.Cell, enabled: bool = True, granularity: str = "auto") -> nn.Cell:
    """Compile ``model``'s pieces with ms.jit (``enabled``), or run them eagerly.

    ``granularity="auto"``: a decoder layer is one graph while nothing inside it is wrapped,
    else its pieces are (see the module doc); ``"region"``: always the pieces (the layer's
    Python stitches them). The head + loss is one graph while no layout has set its hooks.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"apply_compile: granularity must be one of {GRANULARITIES}, not {granularity!r}")
    layers = {id(layer) for layer in _layers(model)}
    cache = GraphCache()
    for _, cell in model.cells_and_names():
        if not isinstance(cell, Block):
            continue
        cell.graph_cache = cache
        whole = granularity == "auto" or id(cell) not in layers
        cell.compiled_pieces = frozenset(cell.PIECES if enabled and whole else ())
    configure_row_blocks(model)
    return model


def is_compiled(model: nn.Cell) -> bool:
    """True if :func:`apply_compile` compiled ``model``'s pieces."""
    return any(isinstance(c, Block) and c.compiled_pieces for _, c in model.cells_and_names())


def apply_recompute(model: nn.Cell, recompute: Any) -> nn.Cell:
    """Recompute activations as ``recompute`` (a ``RecomputeConfig`` or a resolved
    :class:`mindtrain.config.RecomputePlan`) says; once, before the first step.

    Whole layers (``full``): the layer runs through :class:`~mindtrain.models.recompute.Recompute`
    (no activations kept, forward run again in backward; a compiled layer stays compiled).
    A layout that replaces the layer object (ZeRO-3's units, which run the forward again in
    backward anyway) takes over from it. Modules (``select``): each pattern is a regular
    expression matched in full against the dotted sub-cell paths of a layer (``self_attn``,
    ``self_attn.core_attention``, ``mlp``, ``mlp.experts``, ``mlp.shared_experts``, ...;
    MindFormers' names ``self_attention``, ``pre_mlp_layernorm`` and ``mlp.router`` match
    too); a match inside another match is covered by it. A pattern matching nothing is a
    ConfigError.
    """
    layers = _layers(model)
    plan = recompute if isinstance(recompute, RecomputePlan) else recompute_plan(recompute, len(layers))
    if model.layer_runners or model.recompute_wrappers:
        raise RuntimeError("apply_recompute: recompute is already set on this model")
    for i in plan.full:
        model.layer_runners[i] = Recompute(layers[i])
        model.recompute_wrappers[f"model.layers.{i}"] = model.layer_runners[i]
    for pattern, ids in plan.select.items():
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"recompute.select_module.{pattern}", f"is not a regular expression ({e})") from None
        matched = False
        for i in ids:
            paths = [name for name, _ in layers[i].cells_and_names() if name]
            hits = [p for p in paths if module_matches(rx, p)]
            hits = [p for p in hits if not any(p.startswith(q + ".") for q in hits)]
            for path in hits:
                key = f"model.layers.{i}.{path}"
                if key in model.recompute_wrappers or any(key.startswith(k + ".") for k in model.recompute_wrappers):
                    continue
                model.recompute_wrappers[key] = recompute_submodule(dict(layers[i].cells_and_names())[path])
                matched = True
        if not matched:
            names = sorted(p for p, _ in layers[ids[0]].cells_and_names() if p)
            raise ConfigError(f"recompute.select_module.{pattern}",
                              f"matches no module of layer(s) {_ranges(ids)}; modules are e.g. "
                              f"{', '.join(n for n in names if n.count('.') < 2)}")
    model.recompute_plan = plan
    configure_row_blocks(model)
    return model


def core_recomputed(model: nn.Cell, i: int) -> bool:
    """Layer ``i``'s attention core is recomputed: the whole layer, or a selected module
    that is the core or holds it."""
    path = f"model.layers.{i}.self_attn.core_attention"
    return any(path == k or path.startswith(k + ".") for k in model.recompute_wrappers)


def configure_row_blocks(model: nn.Cell) -> None:
    """Layers whose attention core is recomputed run it eagerly in blocks of query rows
    (:meth:`CoreAttention.recompute_in_row_blocks`: no pass holds more than one block's
    scores) when the model is eager or the scores at the configured sequence length
    (batch 1) exceed one block; a compiled layer then runs the pieces around its core."""
    cfg = model.config
    compiled = is_compiled(model)
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        core = getattr(attn, "core_attention", None)
        if core is None:  # an attention without the shared core (DeepSeek-V4's runs its own)
            continue
        core.recompute_in_row_blocks(core_recomputed(model, i) and core_in_row_blocks(
            compiled, attn.num_heads, cfg.seq_length, core.row_block_elements))
