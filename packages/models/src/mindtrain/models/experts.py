"""Routed experts stored stacked ([E, ...] weights) with static-shape, sort-free dispatch.

Every (token, choice) pair goes to a slot in a buffer where each expert's rows are padded
to a multiple of ``block``; one batched matmul over blocks (each block with its expert's
weights) computes all experts at once. Shapes depend only on T, K, E and ``block``, so the
code compiles once under ms.jit and an expert with no tokens needs no special case.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindtrain.config.plan import MOE_BLOCK
from mindspore import Tensor, ops

from mindtrain.models import eager_reshape, kernels
from mindtrain.models.blocks import Block
from mindtrain.models.precision import to_compute
from mindtrain.models.weights import Init, new_weight


def gated_silu(gate, up, limit: float = 0.0):
    """``silu(gate) * up``; with ``limit`` (DeepSeek-V4) the gate is clamped above at it and
    the up projection to [-limit, limit] first."""
    if limit:
        gate = ops.clamp(gate, max=limit)
        up = ops.clamp(up, -limit, limit)
    return ops.silu(gate) * up


class RoutedExperts(Block):
    """``gate_proj [E, I, H]``, ``up_proj [E, I, H]``, ``down_proj [E, H, I]`` (expert dim 0).

    HF checkpoints store these per expert (``experts.{e}.gate_proj.weight``); the checkpoint
    code maps between the two layouts.
    """

    matmul_dtype = None   # mixed precision: the expert matmuls' dtype (None = float32)
    fast_kernels = False

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int, init_std: float = 0.02,
                 block: int = MOE_BLOCK, swiglu_limit: float = 0.0):
        super().__init__()
        self.n_experts = n_experts
        self.swiglu_limit = float(swiglu_limit)  # DeepSeek-V4's clamped SwiGLU (0: none)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.block = block
        normal = Init("normal", init_std)
        self.gate_proj = new_weight((n_experts, intermediate_size, hidden_size), normal, "gate_proj")
        self.up_proj = new_weight((n_experts, intermediate_size, hidden_size), normal, "up_proj")
        self.down_proj = new_weight((n_experts, hidden_size, intermediate_size), normal, "down_proj")
        self.bmm_t = ops.BatchMatMul(transpose_b=True)

    PIECES = ("forward",)

    def piece_weights(self, name: str) -> tuple:
        return self.gate_proj, self.up_proj, self.down_proj

    def activation(self, gate, up):
        """The experts' gated activation of their gate and up projections (a layout that runs
        the experts itself, expert parallelism, calls it)."""
        return gated_silu(gate, up, self.swiglu_limit)

    def construct(self, x, topk_idx, topk_weight):
        if self.graph("forward") is None and not (self.fast_kernels and not self.swiglu_limit):
            return self.forward_host_dispatch(x, topk_idx, topk_weight, *self.piece_weights("forward"))
        return self.run("forward", x, topk_idx, topk_weight)

    def forward(self, x, topk_idx, topk_weight, gate_proj, up_proj, down_proj):
        """x [T, H], topk_idx [T, K] int32, topk_weight [T, K] and the stacked expert weights
        -> ([T, H], tokens per expert [E]); the output is in the matmul dtype."""
        cd = self.matmul_dtype
        if self.fast_kernels and not self.swiglu_limit:
            return kernels.fast_routed_experts(x, topk_idx, topk_weight, gate_proj, up_proj, down_proj, cd)
        t = x.shape[0]
        k = topk_idx.shape[1]
        e = self.n_experts
        b = self.block
        n = t * k
        n_slots = ((n + e * (b - 1)) + b - 1) // b * b
        n_blocks = n_slots // b

        flat_e = topk_idx.reshape(-1)
        one_hot = ops.one_hot(flat_e, e, Tensor(1, ms.int32), Tensor(0, ms.int32))  # [N, E]
        counts = one_hot.sum(0)                                                      # [E]
        rank = (ops.cumsum(one_hot, 0) * one_hot).sum(1) - 1                         # order within expert
        padded = (counts + (b - 1)) // b * b
        ends = ops.cumsum(padded, 0)
        starts = ends - padded
        dest = ops.gather(starts, flat_e, 0) + rank                                  # [N] slot of each pair

        token_of_pair = ops.arange(n, dtype=ms.int32) // k
        # slots no pair fills read the zero row appended at index t
        slot_token = ops.fill(ms.int32, (n_slots,), t)
        slot_token = ops.tensor_scatter_update(slot_token, dest.reshape(-1, 1), token_of_pair)

        block_start = ops.arange(n_blocks, dtype=ms.int32) * b
        block_expert = (ops.expand_dims(block_start, 1) >= ops.expand_dims(ends, 0)).astype(ms.int32).sum(1)
        block_expert = ops.minimum(block_expert, e - 1)
        block_expert = ops.stop_gradient(block_expert)

        # each slot's routing weight (0 for empty slots), applied before down_proj: the
        # weighted sum of the K outputs then is a plain sum of gathered rows
        slot_weight = ops.zeros((n_slots,), topk_weight.dtype)
        slot_weight = ops.tensor_scatter_update(slot_weight, dest.reshape(-1, 1), topk_weight.reshape(-1))
        out = self.slot_outputs(x, slot_token, slot_weight, block_expert, gate_proj, up_proj, down_proj)
        dest_tk = ops.stop_gradient(dest).reshape(t, k)
        y = ops.gather(out, dest_tk[:, 0], 0)
        for j in range(1, k):
            y = y + ops.gather(out, dest_tk[:, j], 0)
        return y, ops.stop_gradient(counts)

    def slot_outputs(self, x, slot_token, slot_weight, block_expert, gate_proj, up_proj, down_proj,
                     reshape=ops.reshape):
        """The experts' outputs per slot [n_slots, H] (:meth:`forward`'s and
        :meth:`forward_host_dispatch`'s compute): slot ``i`` holds token ``slot_token[i]`` of
        ``x`` (``T``: the zero row) weighted by ``slot_weight[i]`` through expert
        ``block_expert[i // block]``. Each block gathers its expert's weights; the routing
        weight is applied before ``down_proj``, so a token's output is a plain sum of its rows.
        ``reshape``: an eager caller's :func:`~mindtrain.models.eager_reshape.reshape`."""
        cd = self.matmul_dtype
        h = x.shape[1]
        b = self.block
        n_slots = slot_token.shape[0]
        n_blocks = n_slots // b
        x_pad = ops.concat((x, ops.zeros((1, h), x.dtype)), 0)
        xb = reshape(ops.gather(to_compute(x_pad, cd), slot_token, 0), (n_blocks, b, h))
        scale = ops.matmul(slot_weight.reshape(-1, 1), ops.ones((1, self.intermediate_size), slot_weight.dtype))
        gate = self.bmm_t(xb, ops.gather(to_compute(gate_proj, cd), block_expert, 0))
        up = self.bmm_t(xb, ops.gather(to_compute(up_proj, cd), block_expert, 0))
        act = gated_silu(gate, up, self.swiglu_limit) * to_compute(reshape(scale, (n_blocks, b, self.intermediate_size)), cd)
        return reshape(self.bmm_t(act, ops.gather(to_compute(down_proj, cd), block_expert, 0)), (n_slots, h))

    def forward_host_dispatch(self, x, topk_idx, topk_weight, gate_proj, up_proj, down_proj):
        """:meth:`forward` for an eager cell: the slots of the (token, choice) pairs, the
        tokens of the slots and the experts of the blocks are index arithmetic on
        ``topk_idx`` (no gradient), done in numpy; the rows, the weights and the matmuls are
        :meth:`forward`'s, so every slot holds the same numbers. Blocks after the last
        filled one are not built (the compiled piece needs the worst case's count)."""
        t = x.shape[0]
        idx = topk_idx.asnumpy().astype(np.int64)
        k = idx.shape[1]
        e, b = self.n_experts, self.block
        flat_e = idx.reshape(-1)
        n = flat_e.shape[0]
        counts = np.bincount(flat_e, minlength=e)
        order = np.argsort(flat_e, kind="stable")                    # pairs by expert, in pair order
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        padded = (counts + (b - 1)) // b * b
        starts = np.cumsum(padded) - padded
        dest = starts[flat_e] + rank                                  # [N] slot of each pair
        n_slots = int(padded.sum())
        slot_token = np.full(n_slots, t, np.int32)                    # empty slots read the zero row
        slot_token[dest] = np.arange(n) // k
        slot_pair = np.full(n_slots, n, np.int32)                     # empty slots weigh 0
        slot_pair[dest] = np.arange(n)
        block_expert = Tensor(np.repeat(np.arange(e, dtype=np.int32), padded // b))

        w_pad = ops.concat((topk_weight.reshape(-1), ops.zeros((1,), topk_weight.dtype)), 0)
        slot_weight = ops.gather(w_pad, Tensor(slot_pair), 0)
        out = self.slot_outputs(x, Tensor(slot_token), slot_weight, block_expert, gate_proj, up_proj, down_proj,
                                eager_reshape.reshape)
        dest_tk = dest.reshape(t, k).astype(np.int32)
        y = ops.gather(out, Tensor(np.ascontiguousarray(dest_tk[:, 0])), 0)
        for j in range(1, k):
            y = y + ops.gather(out, Tensor(np.ascontiguousarray(dest_tk[:, j])), 0)
        return y, Tensor(counts.astype(np.int32))
