"""DeepSeek-V3's sigmoid top-k router with group-limited selection and a correction bias."""

from __future__ import annotations

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer


class TopkRouter(nn.Cell):
    """HF DeepseekV3TopkRouter: ``weight [E, H]`` and ``e_score_correction_bias [E]`` (not trained
    by gradients; moved by the aux-loss-free update).

    ``construct(x [T, H])`` -> (topk_idx [T, K] int32, topk_weight [T, K], scores [T, E]).
    The bias only changes which experts are chosen; the weights come from the unbiased scores.
    """

    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = bool(cfg.norm_topk_prob)
        self.scaling = float(cfg.routed_scaling_factor)
        self.weight = Parameter(initializer(Normal(cfg.initializer_range), (self.n_experts, cfg.hidden_size)),
                                name="weight")
        self.e_score_correction_bias = Parameter(Tensor(np.zeros(self.n_experts, np.float32)),
                                                 name="e_score_correction_bias", requires_grad=False)
        self.matmul = ops.MatMul(transpose_b=True)
        # a list while DeepseekV3ForCausalLM.record_routing(True) is on (eager only)
        self.recorded = None

    def construct(self, x):
        t = x.shape[0]
        scores = ops.sigmoid(self.matmul(x, self.weight))
        choice = ops.stop_gradient(scores) + self.e_score_correction_bias
        if self.n_group > 1:
            per_group = self.n_experts // self.n_group
            top2, _ = ops.topk(choice.reshape(t, self.n_group, per_group), 2)
            group_scores = top2.sum(-1)
            _, group_idx = ops.topk(group_scores, self.topk_group)
            group_mask = ops.one_hot(group_idx, self.n_group, Tensor(1.0, choice.dtype),
                                     Tensor(0.0, choice.dtype)).sum(1)
            expert_mask = ops.broadcast_to(ops.expand_dims(group_mask, -1),
                                           (t, self.n_group, per_group)).reshape(t, self.n_experts)
            choice = ops.select(expert_mask > 0.5, choice, ops.fill(choice.dtype, choice.shape, -1e30))
        _, topk_idx = ops.topk(choice, self.top_k)
        topk_idx = ops.stop_gradient(topk_idx)
        if self.recorded is not None:
            self.recorded.append(topk_idx)
        weights = ops.gather_elements(scores, 1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return topk_idx, weights * self.scaling, scores
