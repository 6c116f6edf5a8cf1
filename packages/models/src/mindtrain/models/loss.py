"""Token cross-entropy averaged over the loss mask."""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops


class MaskedCrossEntropy(nn.Cell):
    """``sum(ce * mask) / max(sum(mask), 1)``; labels < 0 count as masked.

    Uses ``ops.SoftmaxCrossEntropyWithLogits`` (per-token loss, fused backward): 6-20x faster on
    CPU than ``ops.cross_entropy``.
    """

    def __init__(self):
        super().__init__()
        self.ce = ops.SoftmaxCrossEntropyWithLogits()

    def construct(self, logits, labels, loss_mask):
        v = logits.shape[-1]
        logits = logits.reshape(-1, v)
        labels = labels.reshape(-1).astype(ms.int32)
        mask = loss_mask.reshape(-1).astype(logits.dtype)
        valid = labels >= 0
        mask = mask * valid.astype(logits.dtype)
        labels = ops.select(valid, labels, ops.zeros_like(labels))
        target = ops.one_hot(labels, v, Tensor(1.0, logits.dtype), Tensor(0.0, logits.dtype))
        ce, _ = self.ce(logits, target)
        return (ce * mask).sum() / ops.maximum(mask.sum(), Tensor(1.0, logits.dtype))
