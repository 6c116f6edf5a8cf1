"""The recompute section resolved for a model: which layers recompute in full, which
modules of which layers recompute alone. One layer-selection grammar (MindFormers'):

- ``true`` = every layer, ``false`` / ``null`` = none;
- a layer id (``3``), a range string ``"a-b"`` (both ends included, ``"0-3"``), a
  bracketed list string ``"[0-3]"`` / ``"[0, 2-3]"``;
- a list of those; nested lists (MindFormers' one entry per pipeline stage) are joined:
  ids are the model's global layer ids either way.

Layer ids count the decoder layers, then the multi-token-prediction modules
(``num_hidden_layers`` .. ``num_hidden_layers + num_nextn_predict_layers - 1``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from mindtrain.config.errors import ConfigError
from mindtrain.config.schema import RecomputeConfig


@dataclass(frozen=True)
class RecomputePlan:
    full: tuple[int, ...] = ()
    """Layers recomputed whole."""
    select: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Module path pattern (a regular expression matched against a layer's sub-cell paths)
    -> the layers where the matching modules recompute alone."""

    @property
    def active(self) -> bool:
        return bool(self.full or self.select)


ROW_BLOCK_ELEMENTS = 1 << 22
"""Score elements per block of query rows (16 MB of float32; 1,024 rows at 4,096 keys): a
recomputed attention core that runs in blocks (:func:`core_in_row_blocks`) computes its
scores ``ROW_BLOCK_ELEMENTS // S`` rows of one sequence and head at a time, whenever the
micro-batch's scores hold more than one block (mindtrain-models' ``CoreAttention``)."""


def core_in_row_blocks(compiled: bool, heads: int, seq_length: int, block: Optional[int] = None) -> bool:
    """Whether a layer whose attention core is recomputed runs that core eagerly in blocks of
    query rows: always when the model is eager; when it is compiled, only if one sequence's
    scores (``heads x S x S`` at the configured ``seq_length``) exceed a ``block`` (a graph
    would keep them all in its workspace; the layer then compiles the pieces around its core).
    ``block`` defaults to :data:`ROW_BLOCK_ELEMENTS`."""
    block = ROW_BLOCK_ELEMENTS if block is None else block
    return not compiled or heads * seq_length * seq_length > block


# MindFormers' names of a decoder layer's modules (its select_module patterns use them)
_MINDFORMERS_MODULES = (("self_attn", "self_attention"), ("post_attention_layernorm", "pre_mlp_layernorm"),
                        ("mlp.gate", "mlp.router"))


def mindformers_module_path(path: str) -> str:
    """A decoder layer's sub-module path (``self_attn.core_attention``) in MindFormers' names
    (``self_attention.core_attention``)."""
    for ours, theirs in _MINDFORMERS_MODULES:
        if path == ours or path.startswith(ours + "."):
            path = theirs + path[len(ours):]
    return path


_LAYER_GLOB = re.compile(r"^(?:decoder\.)?layers\.\*\.(.+?)(?:\.\*)?$")


def in_layer_pattern(pattern: str) -> str:
    """A ``select_module`` key written as MindFormers' PyNative files write it, a glob over
    the model's module names (``layers.*.self_attention.*``: every module inside each
    layer's attention), as the in-layer pattern mindtrain matches (``self_attention``: the
    attention, whose whole computation those modules are); other keys unchanged."""
    m = _LAYER_GLOB.match(pattern)
    return m.group(1) if m else pattern


def module_matches(pattern, path: str) -> bool:
    """Whether a ``select_module`` regular expression (a string or compiled; MindFormers'
    ``layers.*.<module>.*`` form too, :func:`in_layer_pattern`) names the layer sub-module
    ``path``, written in mindtrain's (HF) or MindFormers' names."""
    text = pattern if isinstance(pattern, str) else pattern.pattern
    inner = in_layer_pattern(text)
    rx = re.compile(inner) if inner != text or isinstance(pattern, str) else pattern
    return bool(rx.fullmatch(path) or rx.fullmatch(mindformers_module_path(path)))


def layer_ids(value: Any, num_layers: int, path: str) -> tuple[int, ...]:
    """The sorted layer ids a selection names (grammar in the module doc); an id outside
    ``[0, num_layers)`` or a malformed entry is a ConfigError naming ``path``."""
    if value is None or value is False:
        return ()
    if value is True:
        return tuple(range(num_layers))
    out: set[int] = set()
    _collect(value, num_layers, path, out)
    return tuple(sorted(out))


def _collect(value: Any, n: int, path: str, out: set[int]) -> None:
    if isinstance(value, bool):
        if value and n < 1 << 30:  # (a syntax check passes n = 2**30: nothing to list)
            out.update(range(n))
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, n, path, out)
        return
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str):
        text = value.replace(" ", "")
        if text.startswith("[") and text.endswith("]"):
            for part in filter(None, text[1:-1].split(",")):
                _collect(part, n, path, out)
            return
        parts = text.split("-")
        if not (len(parts) in (1, 2) and all(p.isdigit() for p in parts)):
            raise ConfigError(path, f"{value!r} is not a layer id or a range \"a-b\" (e.g. \"0-3\")")
        lo, hi = int(parts[0]), int(parts[-1])
    else:
        raise ConfigError(path, f"must be layer ids and \"a-b\" ranges (or true for all), got {value!r}")
    if lo < 0 or lo > hi:
        raise ConfigError(path, f"{value!r}: a range \"a-b\" needs 0 <= a <= b")
    if hi >= n:
        raise ConfigError(path, f"layer {hi} does not exist: the model has layers 0-{n - 1} "
                                f"(decoder layers, then MTP modules)")
    out.update(range(lo, hi + 1))


def recompute_plan(rc: RecomputeConfig, num_layers: int) -> RecomputePlan:
    """Resolve ``rc`` for a model of ``num_layers`` layers (decoder layers + MTP modules).

    ``mode: None`` recomputes nothing. ``mode: full`` recomputes ``full_recompute_layer``
    (every layer when it is not given). ``mode: select`` recomputes ``select_module``'s
    modules, and whole layers too where ``full_recompute_layer`` names them (as in
    MindFormers); a module of a layer that recomputes whole is not wrapped again.
    """
    if rc.mode in (None, "None"):
        return RecomputePlan()
    if rc.mode == "full":
        value = True if rc.full_recompute_layer is None else rc.full_recompute_layer
        full = layer_ids(value, num_layers, "recompute.full_recompute_layer")
        if not full:
            raise ConfigError("recompute.full_recompute_layer", "names no layer while recompute.mode is full; "
                                                                "list layers (e.g. [\"0-3\"]) or set mode: None")
        return RecomputePlan(full=full)
    if rc.mode != "select":
        raise ConfigError("recompute.mode", f"must be None, full or select, got {rc.mode!r}")
    full = layer_ids(rc.full_recompute_layer, num_layers, "recompute.full_recompute_layer")
    sm = rc.select_module
    if not sm:
        raise ConfigError("recompute.select_module", "is required when recompute.mode is select: map module "
                                                     "paths to layers, e.g. {\"self_attn.core_attention\": [\"0-3\"]}")
    items = sm.items() if isinstance(sm, dict) else ((m, True) for m in sm)
    select = {}
    for module, layers in items:
        ids = layer_ids(True if layers is None else layers, num_layers, f"recompute.select_module.{module}")
        ids = tuple(i for i in ids if i not in full)
        if ids:
            select[str(module)] = ids
    return RecomputePlan(full=full, select=select)
