"""RMSNorm written from ops that have CPU kernels (ops.RmsNorm has none on CPU)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindtrain.models import kernels
from mindtrain.models.blocks import Block
from mindtrain.models.weights import Init, new_weight


def rms_norm(x, weight, eps: float):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, in float32 (a lower-precision
    input is cast up first, as HF does; the result stays float32).

    The row mean is a matmul with a constant ``1/h`` column, and the per-row scale times the
    weight is one outer product (``[T, 1] x [1, H]``), which then multiplies ``x``: on the CPU
    backend last-axis reductions and broadcasting multiplies run several times slower than
    matmuls, and every eager op costs ~0.1 ms besides (six ops forward, from twelve: the ones
    vectors and the weight's own outer product are gone). ``x * (s * w)`` rounds once
    differently from HF's ``w * (x * s)`` (within 1 ulp).
    """
    if x.dtype != ms.float32:
        x = ops.cast(x, ms.float32)
    shape = x.shape
    h = shape[-1]
    x2 = x if len(shape) == 2 else x.reshape(-1, h)  # a reshape is a view (eager_reshape)
    mean_sq = ops.matmul(x2 * x2, Tensor(np.full((h, 1), 1.0 / h, np.float32)))   # [T, 1]
    scale = ops.matmul(ops.rsqrt(mean_sq + eps), weight.reshape(1, h))              # [T, H]
    y = x2 * scale
    return y if len(shape) == 2 else y.reshape(shape)


class RMSNorm(Block):
    """HF DeepseekV3RMSNorm (float32 math), parameter ``weight``."""

    fast_kernels = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = new_weight((hidden_size,), Init("ones"), "weight")
        self.eps = float(eps)

    PIECES = ("apply",)

    def construct(self, x):
        return self.run("apply", x)

    def apply(self, x, weight):
        """The norm of ``x`` with ``weight``."""
        if self.fast_kernels:
            return kernels.fast_rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)
