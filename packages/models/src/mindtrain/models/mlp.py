"""SwiGLU feed-forward block (dense layers and shared experts)."""

from __future__ import annotations

from mindtrain.config.plan import Region
from mindtrain.models import kernels
from mindtrain.models.blocks import Block
from mindtrain.models.experts import gated_silu
from mindtrain.models.linear import Linear, linear


class MLP(Block):
    """``down(silu(gate(x)) * up(x))`` with HF names gate_proj / up_proj / down_proj."""

    REGION = Region.declare("mlp")  # its region in the parallel plan (mindtrain.models.parallel_plan)

    PIECES = ("forward",)
    fast_kernels = False
    matmul_dtype = None

    def __init__(self, hidden_size: int, intermediate_size: int, init_std: float = 0.02, swiglu_limit: float = 0.0):
        super().__init__()
        self.swiglu_limit = float(swiglu_limit)  # DeepSeek-V4's clamped SwiGLU (0: none)
        self.gate_proj = Linear(hidden_size, intermediate_size, init_std=init_std)
        self.up_proj = Linear(hidden_size, intermediate_size, init_std=init_std)
        self.down_proj = Linear(intermediate_size, hidden_size, init_std=init_std)

    def piece_weights(self, name: str) -> tuple:
        return self.gate_proj.merged_weight(), self.up_proj.merged_weight(), self.down_proj.merged_weight()

    def construct(self, x):
        return self.run("forward", x)

    def forward(self, x, gate_w, up_w, down_w):
        """The block's math (a layout may replace ``construct`` around it, e.g. tensor
        parallelism's sequence gather)."""
        cd = self.matmul_dtype
        x_gate = x_up = x
        if self.gate_proj.lora_dropout:  # LoRA dropout: each adapter's own input (see Linear.lora_input)
            x_gate = self.gate_proj.lora_input(x)
        if self.up_proj.lora_dropout:
            x_up = self.up_proj.lora_input(x)
        gate, up = linear(x_gate, gate_w, None, cd), linear(x_up, up_w, None, cd)
        if self.fast_kernels and not self.swiglu_limit:
            act = kernels.fast_swiglu(gate, up)
        else:
            act = gated_silu(gate, up, self.swiglu_limit)
        if self.down_proj.lora_dropout:
            act = self.down_proj.lora_input(act)
        return linear(act, down_w, None, cd)
