"""DeepSeek-V3's sigmoid top-k router with group-limited selection and a correction bias."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindtrain.models.blocks import Block

from mindtrain.models.weights import Init, new_weight


# Up to this many candidates, top-k is computed by pairwise ranking ([T, n, n] compares):
# ops.TopK costs several ms per call on CPU even for [1024, 8].
_RANK_LIMIT = 64


def _rank(x):
    """Descending rank of each entry along the last axis (ties: lower index first)."""
    n = x.shape[-1]
    xi = ops.expand_dims(x, -1)
    xj = ops.expand_dims(x, -2)
    before = Tensor(np.tril(np.ones((n, n), np.bool_), -1))  # [i, j]: j < i
    beats = ops.logical_or(xj > xi, ops.logical_and(xj == xi, before))
    return beats.astype(ms.int32).sum(-1)


def _topk_indices_by_rank(x, k: int):
    """Indices [T, k] of the k largest entries of x [T, n], largest first."""
    n = x.shape[-1]
    rank = ops.expand_dims(_rank(x), -1)                                       # [T, n, 1]
    slot = Tensor(np.arange(k, dtype=np.int32).reshape(1, 1, k))
    index = Tensor(np.arange(n, dtype=np.int32).reshape(1, n, 1))
    return ((rank == slot).astype(ms.int32) * index).sum(1)


class TopkRouter(Block):
    """HF DeepseekV3TopkRouter: ``weight [E, H]`` and ``e_score_correction_bias [E]`` (not trained
    by gradients; moved by the aux-loss-free update).

    ``construct(x [T, H])`` -> (topk_idx [T, K] int32, topk_weight [T, K], scores [T, E]).
    The bias only changes which experts are chosen; the weights come from the unbiased scores.
    """

    PIECES = ("forward",)

    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = bool(cfg.norm_topk_prob)
        self.scaling = float(cfg.routed_scaling_factor)
        self.weight = new_weight((self.n_experts, cfg.hidden_size), Init("normal", cfg.initializer_range), "weight")
        self.e_score_correction_bias = new_weight((self.n_experts,), Init("zeros"), "e_score_correction_bias",
                                                  requires_grad=False)
        self.matmul = ops.MatMul(transpose_b=True)
        # a list while DeepseekV3ForCausalLM.record_routing(True) is on (eager only)
        self.recorded = None

    def piece_weights(self, name: str) -> tuple:
        return self.weight, self.e_score_correction_bias

    def construct(self, x):
        if self.graph("forward") is None:
            out = self.route_on_host(x, *self.piece_weights("forward"))
        else:
            out = self.run("forward", x)
        if self.recorded is not None:
            self.recorded.append(out[0])
        return out

    def forward(self, x, weight, bias):
        """Routing of ``x`` [T, H] with the router ``weight`` and correction ``bias``."""
        t = x.shape[0]
        scores = ops.sigmoid(self.matmul(x, weight))
        choice = ops.stop_gradient(scores) + bias
        if self.n_group > 1:
            per_group = self.n_experts // self.n_group
            grouped = choice.reshape(t, self.n_group, per_group)
            if per_group == 2:
                group_scores = grouped.sum(-1)
            elif per_group <= _RANK_LIMIT:
                top2 = (_rank(grouped) < 2).astype(choice.dtype)
                group_scores = (grouped * top2).sum(-1)
            else:
                group_scores = ops.topk(grouped, 2)[0].sum(-1)
            if self.n_group <= _RANK_LIMIT:
                group_mask = (_rank(group_scores) < self.topk_group).astype(choice.dtype)
            else:
                _, group_idx = ops.topk(group_scores, self.topk_group)
                group_mask = ops.one_hot(group_idx, self.n_group, Tensor(1.0, choice.dtype),
                                         Tensor(0.0, choice.dtype)).sum(1)
            expert_mask = ops.broadcast_to(ops.expand_dims(group_mask, -1),
                                           (t, self.n_group, per_group)).reshape(t, self.n_experts)
            choice = ops.select(expert_mask > 0.5, choice, ops.fill(choice.dtype, choice.shape, -1e30))
        if self.n_experts <= _RANK_LIMIT:
            topk_idx = _topk_indices_by_rank(choice, self.top_k)
        else:
            _, topk_idx = ops.topk(choice, self.top_k)
        topk_idx = ops.stop_gradient(topk_idx)
        return topk_idx, self.chosen_weights(scores, topk_idx), scores

    def chosen_weights(self, scores, topk_idx):
        """The routing weights [T, K] of the chosen experts: their unbiased scores,
        normalised to sum 1 per token (``norm_topk_prob``), times ``routed_scaling_factor``."""
        weights = ops.gather_elements(scores, 1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.scaling

    def route_on_host(self, x, weight, bias):
        """:meth:`forward` for an eager cell: the choice of experts (no gradient: comparisons
        of the scores) in numpy, the scores and the chosen weights in MindSpore. The same
        choice as :meth:`forward` (ties to the lower index, the groups by the sum of their two
        best scores, float32 sums); about 25 small eager ops a layer fewer (each ~0.1-0.4 ms
        on CPU, a dtype cast ~0.35 ms)."""
        scores = ops.sigmoid(self.matmul(x, weight))
        choice = scores.asnumpy() + bias.asnumpy()
        t = choice.shape[0]
        if self.n_group > 1:
            grouped = choice.reshape(t, self.n_group, -1)
            if grouped.shape[-1] == 2:
                group_scores = grouped.sum(-1)
            else:
                top2 = np.sort(grouped, -1)[..., -2:]
                group_scores = top2[..., 1] + top2[..., 0]
            groups = _top_indices(group_scores, self.topk_group)
            keep = np.zeros(group_scores.shape, np.bool_)
            np.put_along_axis(keep, groups, True, -1)
            choice = np.where(np.repeat(keep, grouped.shape[-1], -1), choice, np.float32(-1e30))
        topk_idx = Tensor(_top_indices(choice, self.top_k).astype(np.int32))
        return topk_idx, self.chosen_weights(scores, topk_idx), scores


def _top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices [T, k] of the k largest entries of each row of ``x``, largest first, ties to
    the lower index (as :func:`_topk_indices_by_rank`)."""
    return np.argsort(-x, axis=-1, kind="stable")[:, :k]
