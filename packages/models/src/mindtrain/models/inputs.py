"""The model's input rules in plain numpy, stated once: which keys a query may not see
(causality plus packed documents), the additive mask value, and the MTP shift.

:func:`mindtrain.models.attention_mask.additive_mask` and the model's forward use these;
so does context parallelism, through the model's
:meth:`~mindtrain.models.DeepseekV3ForCausalLM.whole_sequence_inputs` (the parallel package
never imports this one: the trainer hands it the model). Nothing here imports MindSpore.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from mindtrain.config import ConfigError

NEG = -1e9
"""Additive mask value for a blocked key: exp() of it underflows to exactly 0 in float32,
as HF's finfo.min does."""


def blocked_matrix(attention_mask: Optional[np.ndarray], batch: int, seq: int) -> np.ndarray:
    """[B, S, S] bool, True where query i may not see key j: causality plus the packed
    document mask. ``attention_mask`` is None (causal only), a Megatron mask [B, 1, S, S] /
    [B, S, S] (True / 1 = masked out) or the compressed EOD form [B, L] holding each
    document's end position (exclusive, cumulative) padded with S. A [1, ...] mask applies
    to the whole batch."""
    causal = np.triu(np.ones((seq, seq), dtype=bool), 1)
    if attention_mask is None:
        return np.broadcast_to(causal, (batch, seq, seq))
    m = np.asarray(attention_mask)
    if m.ndim == 2:
        pos = np.arange(seq)
        doc = (m[:, None, :] <= pos[None, :, None]).sum(-1)  # [B, S]: document index of each position
        return np.broadcast_to((doc[:, :, None] != doc[:, None, :]) | causal, (batch, seq, seq))
    if m.ndim == 4:
        m = m[:, 0]
    if m.ndim != 3 or m.shape[-2:] != (seq, seq):
        raise ConfigError("attention_mask", f"expected [B, 1, {seq}, {seq}] or [B, eod_pad_length], "
                                            f"got {tuple(np.shape(attention_mask))}")
    return np.broadcast_to(m.astype(bool) | causal, (batch, seq, seq))


def additive(blocked: np.ndarray, heads: int) -> np.ndarray:
    """[B, heads, Sq, Sk] float32 from a [B, Sq, Sk] bool ``blocked``: 0 where attention is
    allowed and :data:`NEG` elsewhere, materialised for every head (adding a broadcast mask
    was 3-13x slower on CPU)."""
    add = np.where(blocked, np.float32(NEG), np.float32(0.0))[:, None]
    return np.ascontiguousarray(np.broadcast_to(add, (add.shape[0], heads) + add.shape[2:]))


def shift_left(x: np.ndarray, k: int) -> np.ndarray:
    """``x[:, k:]`` followed by ``k`` zeros: position i holds what was at i + k (the inputs
    and targets of MTP depth k)."""
    x = np.asarray(x)
    out = np.zeros_like(x)
    out[:, :x.shape[1] - k] = x[:, k:]
    return out


def whole_sequence_inputs(batch: Mapping[str, Any], mtp_depths: int = 0) -> dict[str, Any]:
    """Everything one forward reads, for whole sequences, as numpy.

    ``batch`` holds ``input_ids`` and ``labels`` [B, S] and optionally ``loss_mask``,
    ``position_ids`` and ``attention_mask`` (any form :func:`blocked_matrix` takes).
    Returns ``input_ids``, ``labels``, ``loss_mask`` (float32, ones when absent),
    ``position_ids`` (0..S-1 when absent), ``mask_add`` [B, 1, S, S] float32 (the additive
    mask, one head; :func:`additive` of :func:`blocked_matrix`), and ``mtp``: per
    depth k = 1..``mtp_depths`` a dict of that depth's ``input_ids``, ``labels`` and
    ``loss_mask`` (each shifted left by k on the whole sequence).
    """
    ids = np.asarray(batch["input_ids"])
    b, s = ids.shape
    labels = np.asarray(batch["labels"])
    loss_mask = batch.get("loss_mask")
    loss_mask = np.ones((b, s), np.float32) if loss_mask is None else np.asarray(loss_mask, np.float32)
    pos = batch.get("position_ids")
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)) if pos is None else np.asarray(pos)
    out = {"input_ids": ids, "labels": labels, "loss_mask": loss_mask, "position_ids": pos,
           "mask_add": additive(blocked_matrix(batch.get("attention_mask"), b, s), 1), "mtp": []}
    for k in range(1, mtp_depths + 1):
        out["mtp"].append({"input_ids": shift_left(ids, k), "labels": shift_left(labels, k),
                           "loss_mask": shift_left(loss_mask, k)})
    return out
