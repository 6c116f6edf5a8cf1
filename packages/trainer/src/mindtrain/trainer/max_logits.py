"""The step's max attention logits (MindFormers' ``track_max_attention_logit``), for Muon's
QK-clip and the MaxLogitsMonitor callback.

The model records, per layer and head, the largest pre-softmax logit of the step's forwards
(:func:`mindtrain.models.attention.track_max_attention_logits`: every micro-batch, eager or
compiled). Across ranks the table is a maximum: data-parallel and context-parallel ranks
saw other samples or query rows of the same heads, pipeline stages hold other layers, and
tensor-parallel ranks other heads (a contiguous block each). The CPU collectives have no
MAX reduction, so each rank writes its own row of a ``[world, layers, heads]`` table
(``-inf`` where it holds nothing), one SUM all-reduce gathers them, and every rank takes the
maximum over the rows: the same full table everywhere. MindFormers reduces over dp x cp
and gathers the TP shards (``full_tensor``); each stage then clips its own layers.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np


def wants_max_logits(cfg) -> bool:
    """The model must track its max logits: Muon with ``qk_clip_enabled``, or a
    MaxLogitsMonitor callback (MindFormers' ``configure_max_logits_tracking``)."""
    o = cfg.optimizer
    clip = o.type == "Muon" and bool(o.qk_clip_enabled)
    return clip or any(c.type in ("MaxLogitsMonitor", "MaxLogitsReset") for c in cfg.callbacks)


def num_attention_layers(model) -> int:
    return len(model.model.layers)


def synced_max_logits(model, all_sum: Optional[Callable[[np.ndarray], np.ndarray]], rank: int, world: int,
                      tp_rank: int = 0) -> dict[int, np.ndarray]:
    """``{layer: [heads] float32}``: the max logit of every head of every layer over the
    step's forwards on all ranks (see the module doc); resets the model's record. Every rank
    calls it (one collective when ``world > 1``)."""
    from mindtrain.models.attention import max_attention_logits

    local = max_attention_logits(model, reset=True)
    layers = num_attention_layers(model)
    heads = int(model.config.num_attention_heads)
    table = np.full((world, layers, heads), -np.inf, np.float32)
    for i, m in local.items():
        n = m.shape[0]  # this rank's heads: block tp_rank of the layer's heads
        table[rank, i, tp_rank * n:(tp_rank + 1) * n] = m
    if world > 1:
        mine = table[rank].copy()
        buf = np.zeros_like(table)
        buf[rank] = np.where(np.isfinite(mine), mine, 0.0)
        present = np.zeros_like(table)
        present[rank] = np.isfinite(mine)
        both = all_sum(np.concatenate([buf.reshape(-1), present.reshape(-1)])).reshape((2,) + table.shape)
        table = np.where(both[1] > 0, both[0], -np.inf)
    full = table.max(axis=0)
    return {i: full[i] for i in range(layers) if np.all(np.isfinite(full[i]))}


def reset_max_logits(model) -> None:
    """Drop what the model recorded (forwards outside a training step: evaluation)."""
    from mindtrain.models.attention import max_attention_logits

    max_attention_logits(model, reset=True)
