"""RMSNorm written from ops that have CPU kernels (ops.RmsNorm has none on CPU)."""

from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops


class RMSNorm(nn.Cell):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 like HF's DeepseekV3RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(hidden_size, np.float32)), name="weight")
        self.eps = float(eps)

    def construct(self, x):
        variance = ops.mean(ops.square(x), -1, keep_dims=True)
        return self.weight * (x * ops.rsqrt(variance + self.eps))
