"""Additive attention masks: causal, plus document boundaries of packed samples.

The rules (which keys are blocked, the mask value) are the numpy ones of
:mod:`mindtrain.models.inputs`; this module turns them into the model's mask Tensor.
"""

from __future__ import annotations

from mindspore import Tensor

from mindtrain.models.inputs import additive, blocked_matrix


def additive_mask(attention_mask, batch: int, seq: int, heads: int) -> Tensor:
    """[B, heads, S, S] float32 with 0 where attention is allowed and -1e9 elsewhere.

    ``attention_mask`` is None (causal only), a Megatron mask [B, 1, S, S] / [B, S, S]
    (True / 1 = masked out), or the compressed EOD form [B, L] holding each document's end
    position (exclusive, cumulative) padded with S, as a Tensor or numpy array. Always
    combined with causality (see :func:`mindtrain.models.inputs.blocked_matrix`).
    """
    m = attention_mask
    if isinstance(m, Tensor):
        m = m.asnumpy()
    return Tensor(additive(blocked_matrix(m, batch, seq), heads))
