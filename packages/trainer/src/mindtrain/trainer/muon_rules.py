"""Which parameters Muon updates, and how much its distributed update gathers at once: the
rules :mod:`mindtrain.trainer.muon` applies and ``mindtrain-estimate`` counts (plain Python:
the estimator runs without numpy or MindSpore)."""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Optional, Sequence

# MindFormers' default adamw_include: its embedding and output layer go to AdamW
DEFAULT_ADAMW_INCLUDE = ("*word_embeddings*", "*output_layer*")
# whole float32 arrays one gather of the distributed update holds at most (a larger matrix alone)
GATHER_BYTES = 64 * 2 ** 20
# MindFormers' names of the top-level weights (its names inside the layers need the full map,
# mindtrain.trainer.mindformers_names)
TOP_NAMES = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
             "lm_head.weight": "output_layer.weight", "model.norm.weight": "decoder.final_layernorm.weight"}


def uses_muon(name: str, shape: Sequence[int], adamw_include: Optional[Sequence[str]],
              theirs: Optional[str] = None) -> bool:
    """Whether Muon (not AdamW) updates parameter ``name`` of full shape ``shape``: a 2-D
    matrix or stacked ``[E, rows, cols]`` experts that no ``adamw_include`` glob names, in
    mindtrain's name or in MindFormers' (``theirs``; default: :data:`TOP_NAMES`' entry)."""
    if len(shape) not in (2, 3):
        return False
    include = tuple(adamw_include) if adamw_include is not None else DEFAULT_ADAMW_INCLUDE
    if theirs is None:
        theirs = TOP_NAMES.get(name)
    return not any(fnmatch(name, g) or (theirs is not None and fnmatch(theirs, g)) for g in include)


__all__ = ["DEFAULT_ADAMW_INCLUDE", "GATHER_BYTES", "TOP_NAMES", "uses_muon"]
