"""SwiGLU feed-forward block (dense layers and shared experts)."""

from __future__ import annotations

from mindspore import nn, ops

from mindtrain.models import kernels
from mindtrain.models.linear import Linear


class MLP(nn.Cell):
    """``down(silu(gate(x)) * up(x))`` with HF names gate_proj / up_proj / down_proj."""

    fast_kernels = False

    def __init__(self, hidden_size: int, intermediate_size: int, init_std: float = 0.02):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, init_std=init_std)
        self.up_proj = Linear(hidden_size, intermediate_size, init_std=init_std)
        self.down_proj = Linear(intermediate_size, hidden_size, init_std=init_std)

    def construct(self, x):
        return self.forward(x)

    def forward(self, x):
        """The block's math; compiled on its own when the model compiles regions (a layout
        may replace ``construct`` around it, e.g. tensor parallelism's sequence gather)."""
        if self.fast_kernels:
            return self.down_proj(kernels.fast_swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))
