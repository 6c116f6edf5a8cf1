"""The rope tables and additive mask a causal LM's forward needs, cached per batch shape.

The default-position tables (0..S-1 in every row) and the causal-only mask are the same every
step, so they are built once per (B, S); position ids that are 0..S-1 in every row (the
loader's, without reset at documents) use the cached tables too.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, ops

from mindtrain.models.attention_mask import additive_mask

MAX_ENTRIES = 8
"""More shapes than this (e.g. evaluation at other lengths) empty the cache: memory stays bounded."""


def default_positions(position_ids, s: int) -> bool:
    """True if ``position_ids`` [B, S] is 0..S-1 in every row (checked on the host: [B, S] ints)."""
    pos = position_ids.asnumpy() if isinstance(position_ids, Tensor) else np.asarray(position_ids)
    return pos.ndim == 2 and pos.shape[1] == s and bool((pos == np.arange(s, dtype=pos.dtype)).all())


def rope_and_mask(model, b: int, s: int, position_ids, attention_mask):
    """``(cos, sin, mask_add)`` for a forward of ``model`` (a causal LM with ``model.rotary_emb``,
    a ``rope(position_ids)`` method and ``config.num_attention_heads``): cos/sin [B, 1, S, rope]
    and the additive mask, cached in ``model._rope_mask_cache``."""
    cache = model._rope_mask_cache
    if position_ids is not None and default_positions(position_ids, s):
        position_ids = None
    if position_ids is None:
        if ("rope", b, s) not in cache:
            pos = Tensor(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy())
            cos, sin = model.model.rotary_emb(pos)
            cache[("rope", b, s)] = (ops.expand_dims(cos, 1), ops.expand_dims(sin, 1))
        cos, sin = cache[("rope", b, s)]
    else:
        cos, sin = model.rope(position_ids)
    heads = model.config.num_attention_heads
    if attention_mask is None:
        if ("mask", b, s) not in cache:
            cache[("mask", b, s)] = additive_mask(None, b, s, heads)
        mask_add = cache[("mask", b, s)]
    else:
        mask_add = additive_mask(attention_mask, b, s, heads)
    if len(cache) > MAX_ENTRIES:
        model._rope_mask_cache = {}
    return cos, sin, mask_add
