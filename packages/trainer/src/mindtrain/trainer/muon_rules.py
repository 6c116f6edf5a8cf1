"""Which parameters Muon updates, and how much its distributed update gathers at once: the
rules :mod:`mindtrain.trainer.muon` applies and ``mindtrain-estimate`` counts (plain Python:
the estimator runs without numpy or MindSpore)."""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any, Optional, Sequence

from mindtrain.trainer.mindformers_name_table import TOP_NAMES, locate

# MindFormers' default adamw_include: its embedding and output layer go to AdamW
DEFAULT_ADAMW_INCLUDE = ("*word_embeddings*", "*output_layer*")
# LoRA's adapters of a Linear's ``weight`` (mindtrain.models.lora): ``<layer>.lora_a`` / ``.lora_b``
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
# whole float32 arrays one gather of the distributed update holds at most (a larger matrix alone)
GATHER_BYTES = 64 * 2 ** 20


def mindformers_name(name: str, model: Any = None) -> Optional[str]:
    """MindFormers' name of parameter ``name`` (:mod:`mindtrain.trainer.mindformers_name_table`,
    the model config ``model`` picking the family's map); without ``model`` only the top-level
    weights' (:data:`TOP_NAMES`). None for a name the map does not know."""
    if model is None:
        return TOP_NAMES.get(name)
    try:
        return locate(name, model)[0]
    except Exception:  # a name the map does not know: only ours is matched
        return None


def uses_muon(name: str, shape: Sequence[int], adamw_include: Optional[Sequence[str]], model: Any = None) -> bool:
    """Whether Muon (not AdamW) updates parameter ``name`` of full shape ``shape``: a 2-D
    matrix or stacked ``[E, rows, cols]`` experts that no ``adamw_include`` glob names, in
    mindtrain's name or in MindFormers' (:func:`mindformers_name`; ``model``: the model
    config; a LoRA adapter by its layer's MindFormers name, ``output_layer.lora_a``). The optimizer (:mod:`mindtrain.trainer.muon`) and ``mindtrain-estimate`` both
    decide with this."""
    if len(shape) not in (2, 3):
        return False
    include = tuple(adamw_include) if adamw_include is not None else DEFAULT_ADAMW_INCLUDE
    adapter = name.endswith(ADAPTER_SUFFIXES)
    theirs = mindformers_name(name[:name.rindex(".")] + ".weight" if adapter else name, model)
    if adapter and theirs is not None:  # a LoRA adapter: its layer's MindFormers name, MindFormers' suffix
        theirs = theirs[:-len(".weight")] + name[name.rindex("."):]
    return not any(fnmatch(name, g) or (theirs is not None and fnmatch(theirs, g)) for g in include)


def muon_matrix(name: str, model: Any = None) -> str:
    """The one matrix Newton-Schulz orthogonalises parameter ``name`` as (a part of): a LoRA
    ``lora_b`` of a part of a layer MindFormers fuses (``linear_qkv``: MLA's q + kv, Qwen3's q, k,
    v; ``linear_fc1``: gate + up) is rows of MindFormers' one parameter ``<fused layer>.lora_b``
    [sum(out), r], which its Muon orthogonalises whole (its split schema names only the fused
    ``.weight``); those parts share that key. Every other parameter is its own matrix (its name).
    Without ``model`` (or for a name the map does not know): the name."""
    if model is None or not name.endswith(".lora_b"):
        return name
    theirs = mindformers_name(name[:-len(".lora_b")] + ".weight", model)
    return name if theirs is None or not theirs.endswith(".weight") else theirs[:-len(".weight")] + ".lora_b"


__all__ = ["ADAPTER_SUFFIXES", "DEFAULT_ADAMW_INCLUDE", "GATHER_BYTES", "TOP_NAMES", "mindformers_name", "muon_matrix",
           "uses_muon"]
