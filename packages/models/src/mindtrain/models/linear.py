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
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        shape = x.shape
        cd = self.matmul_dtype
        y = self.matmul(to_compute(x.reshape(-1, shape[-1]), cd), to_compute(self.weight, cd))
        if self.bias is not None:
            y = y + to_compute(self.bias, cd)
        return y.reshape(shape[:-1] + (self.out_features,))
