"""A bias-free (or biased) linear layer with an HF-shaped ``[out, in]`` weight."""

from __future__ import annotations

from mindspore import nn, ops

from mindtrain.models.precision import to_compute
from mindtrain.models.weights import Init, new_weight


class Linear(nn.Cell):
    """``y = x @ weight.T (+ bias)``; ``ops.MatMul(transpose_b=True)`` is the fastest CPU form.
    With ``matmul_dtype`` set (mixed precision) the product and the output are in that dtype."""

    matmul_dtype = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_weight((out_features, in_features), Init("normal", init_std), "weight")
        self.bias = new_weight((out_features,), Init("zeros"), "bias") if bias else None
        self.lora_scaling = None
        """``lora_alpha / lora_rank`` once :func:`mindtrain.models.lora.add_adapter` gave the
        layer ``lora_a`` [r, in] and ``lora_b`` [out, r]; None without an adapter."""

    def merged_weight(self):
        """The weight the layer multiplies by: ``weight``, or with an adapter
        ``weight + scaling * lora_b @ lora_a`` (computed at each use, so gradients reach
        ``lora_a`` and ``lora_b``; on a layout's pieces: a TP slice of ``weight`` with the
        matching slice of ``lora_b`` (column split) or ``lora_a`` (row split))."""
        if self.lora_scaling is None:
            return self.weight
        return self.weight + _MATMUL(self.lora_b, self.lora_a) * self.lora_scaling

    def construct(self, x):
        return linear(x, self.merged_weight(), self.bias, self.matmul_dtype)


_MATMUL_T = ops.MatMul(transpose_b=True)
_MATMUL = ops.MatMul()


def linear(x, weight, bias=None, cd=None):
    """``x @ weight.T (+ bias)`` over the last axis of ``x``, in ``cd`` (None: float32)."""
    shape = x.shape
    y = _MATMUL_T(to_compute(x.reshape(-1, shape[-1]), cd), to_compute(weight, cd))
    if bias is not None:
        y = y + to_compute(bias, cd)
    return y.reshape(shape[:-1] + (weight.shape[0],))
