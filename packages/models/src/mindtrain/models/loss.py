"""Token cross-entropy averaged over the loss mask."""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops


class TokenCrossEntropy(nn.Cell):
    """Per-token ``logsumexp(logits) - logits[label]`` ([N, V], [N] int32 -> [N]).

    The backward is written out (``(softmax - onehot) * dout``): the built-in CE ops were
    14x (SoftmaxCrossEntropyWithLogits) to 20x (cross_entropy) slower on CPU at [1024, 4096].
    It reuses the forward's softmax (:class:`_CrossEntropyAndProbs` returns it to its
    backward) instead of computing the [N, V] softmax again.
    """

    def __init__(self):
        super().__init__()
        self.ce = _CrossEntropyAndProbs()

    def construct(self, logits, labels):
        return self.ce(logits, labels)[0]


class _CrossEntropyAndProbs(nn.Cell):
    """``(per-token cross-entropy [N], softmax [N, V])``; the softmax output is for the
    backward only (nothing may use it: its gradient is ignored)."""

    def __init__(self):
        super().__init__()
        self.softmax = ops.Softmax(-1)
        self.argmax = ops.ArgMaxWithValue(-1)

    def construct(self, logits, labels):
        # logsumexp = max - log(softmax at the max): no broadcast subtract, no exp pass of our
        # own (both slow on CPU), and softmax at the max is >= 1/V so the log is safe
        top, m = self.argmax(logits)
        p = self.softmax(logits)
        p_top = ops.gather_elements(p, 1, top.reshape(-1, 1).astype(ms.int32)).reshape(-1)
        picked = ops.gather_elements(logits, 1, labels.reshape(-1, 1)).reshape(-1)
        return (m - ops.log(p_top)) - picked, p

    def bprop(self, logits, labels, out, dout):
        v = logits.shape[-1]
        d = dout[0]
        scale = ops.matmul(d.reshape(-1, 1), ops.ones((1, v), logits.dtype))  # outer product
        g = out[1] * scale
        g = ops.tensor_scatter_elements(g, labels.reshape(-1, 1), -d.reshape(-1, 1), 1, "add")
        return g, ops.zeros_like(labels)


class MaskedCrossEntropy(nn.Cell):
    """``sum(ce * mask) / max(sum(mask), 1)``; labels < 0 count as masked.

    ``token_loss`` is the per-token cross-entropy (``[N, V], [N] int32 -> [N]``,
    :class:`TokenCrossEntropy` by default), the one component a layout may swap: tensor
    parallelism puts a vocabulary-parallel one there (the logits then hold this rank's
    vocabulary slice, the labels stay global). Masking and the mean stay here.
    """

    def __init__(self):
        super().__init__()
        self.token_loss = TokenCrossEntropy()

    def construct(self, logits, labels, loss_mask):
        v = logits.shape[-1]
        if len(logits.shape) != 2:  # a reshape is a view (mindtrain.models.eager_reshape)
            logits = logits.reshape(-1, v)
        labels = labels.reshape(-1).astype(ms.int32)
        mask = loss_mask.reshape(-1).astype(logits.dtype)
        valid = labels >= 0
        mask = mask * valid.astype(logits.dtype)
        labels = ops.select(valid, labels, ops.zeros_like(labels))
        ce = self.token_loss(logits, labels)
        return (ce * mask).sum() / ops.maximum(mask.sum(), Tensor(1.0, logits.dtype))
