"""A bias-free (or biased) linear layer with an HF-shaped ``[out, in]`` weight."""

from __future__ import annotations

from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer


class Linear(nn.Cell):
    """``y = x @ weight.T (+ bias)``; ``ops.MatMul(transpose_b=True)`` is the fastest CPU form."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(initializer(Normal(init_std), (out_features, in_features)), name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,)), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(shape[:-1] + (self.out_features,))
