"""RMSNorm written from ops that have CPU kernels (ops.RmsNorm has none on CPU)."""

from __future__ import annotations

import mindspore as ms
from mindspore import ops

from mindtrain.models import kernels
from mindtrain.models.blocks import Block
from mindtrain.models.weights import Init, new_weight


def rms_norm(x, weight, eps: float):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, in float32 (a lower-precision
    input is cast up first, as HF does; the result stays float32).

    The row mean and both broadcasts are done as matmuls: on the CPU backend last-axis
    reductions and broadcasting multiplies run several times slower than a matmul with a
    ones vector / an outer product; the weight's gradient then is a matmul too.
    """
    if x.dtype != ms.float32:
        x = ops.cast(x, ms.float32)
    shape = x.shape
    h = shape[-1]
    x2 = x.reshape(-1, h)
    t = x2.shape[0]
    # the row sums times 1/h (a FillV2 of 1/h costs an eager Cast: ~0.4 ms on CPU)
    sum_sq = ops.matmul(x2 * x2, ops.ones((h, 1), x2.dtype))                     # [T, 1]
    inv = ops.matmul(ops.rsqrt(sum_sq * (1.0 / h) + eps), ops.ones((1, h), x2.dtype))  # [T, H]
    w = ops.matmul(ops.ones((t, 1), x2.dtype), weight.reshape(1, h))             # [T, H]
    return (w * (x2 * inv)).reshape(shape)


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
