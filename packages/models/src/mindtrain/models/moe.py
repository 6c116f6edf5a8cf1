"""Mixture of experts block: router (``gate``), routed ``experts``, ``shared_experts``."""

from __future__ import annotations

from mindspore import Tensor, ops

from mindtrain.config.plan import MOE_BLOCK, Region
from mindtrain.models.blocks import Block

from mindtrain.models.experts import RoutedExperts
from mindtrain.models.mlp import MLP
from mindtrain.models.router import TopkRouter


def sequence_balance_loss(scores, topk_idx, batch: int, n_experts: int, sequence_reduce=None):
    """DeepSeek-V3's sequence-wise balance loss ``mean_b sum_i f_i P_i`` (without alpha).

    ``f_i = E / (K S) * #tokens of the sequence routed to i``, ``P_i`` = mean over the sequence
    of the scores normalised to sum 1 per token. scores [T, E], topk_idx [T, K]; T = batch * S.

    ``sequence_reduce`` (context parallelism: each rank holds part of every sequence) maps
    ``(counts [B, E], S)`` to the whole sequences' ``(counts, S)``; the result is then this
    rank's share of the loss (the shares of all ranks sum to it).
    """
    t, k = topk_idx.shape
    s = t // batch
    chosen = ops.one_hot(topk_idx, n_experts, Tensor(1.0, scores.dtype), Tensor(0.0, scores.dtype))
    if sequence_reduce is not None:
        counts, s_all = sequence_reduce(ops.stop_gradient(chosen.reshape(batch, s * k, n_experts).sum(1)), s)
        f = counts * (n_experts / (k * s_all))
        p = (scores / scores.sum(-1, keepdims=True)).reshape(batch, s, n_experts).sum(1) / s_all
        return (ops.stop_gradient(f) * p).sum(-1).mean()
    f = chosen.reshape(batch, s * k, n_experts).sum(1) * (n_experts / (k * s))
    p = (scores / scores.sum(-1, keepdims=True)).reshape(batch, s, n_experts).mean(1)
    return (ops.stop_gradient(f) * p).sum(-1).mean()


class MoE(Block):
    """``construct(x [B,S,H])`` -> (y [B,S,H], tokens per expert [E], balance loss scalar)."""

    REGION = Region.declare("moe")  # its region in the parallel plan (mindtrain.models.parallel_plan)

    def __init__(self, cfg, block: int = MOE_BLOCK):
        super().__init__()
        std = cfg.initializer_range
        self.n_experts = cfg.n_routed_experts
        self.gate = TopkRouter(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     init_std=std, block=block)
        self.n_shared = cfg.n_shared_experts
        if self.n_shared:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      init_std=std)
        # context-parallel hook, see sequence_balance_loss
        self.sequence_reduce = None

    def shared_output(self, x):
        """The shared experts' output for ``x`` [B,S,H], or None without shared experts (for
        a layout that runs the routed part itself, e.g. tensor parallelism)."""
        return self.shared_experts(x) if self.n_shared else None

    def sharded_balance(self, scores, topk_idx, counts, batch: int, seq: int, sum_counts, sum_scores):
        """The balance loss when this rank routed one shard of every sequence (tensor
        parallelism's sequence shards): ``scores`` [T, E] and ``topk_idx`` [T, K] of the local
        ``T = batch x S_local`` tokens, ``seq`` the whole sequence's length. ``sum_counts``
        sums a statistic over the shards (no gradient), ``sum_scores`` sums one whose gradient
        stays this rank's (forward all-reduce, backward identity). ``counts`` (the experts'
        token counts, already whole) is not needed: DeepSeek-V3's balance is per sequence.
        With the context-parallel hook the result is this CP rank's share."""
        n_experts = self.n_experts
        t, k = topk_idx.shape
        s_local = t // batch
        chosen = ops.one_hot(topk_idx, n_experts, Tensor(1.0, scores.dtype), Tensor(0.0, scores.dtype))
        per_seq = ops.stop_gradient(sum_counts(chosen.reshape(batch, s_local * k, n_experts).sum(1)))
        if self.sequence_reduce is not None:
            per_seq, seq = self.sequence_reduce(per_seq, seq)
        f = ops.stop_gradient(per_seq) * (n_experts / (k * seq))
        p = sum_scores((scores / scores.sum(-1, keepdims=True)).reshape(batch, s_local, n_experts).sum(1)) / seq
        return (f * p).sum(-1).mean()

    def piece_weights(self, name: str) -> tuple:
        shared = self.shared_experts.piece_weights("forward") if self.n_shared else ()
        return self.gate.piece_weights("forward") + self.experts.piece_weights("forward") + shared

    def construct(self, x):
        """Through the sub-cells (each may be compiled, or wrapped by a layout)."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        topk_idx, topk_weight, scores = self.gate(flat)
        y, counts = self.experts(flat, topk_idx, topk_weight)
        y = y.reshape(b, s, h)
        if self.n_shared:
            y = y + self.shared_experts(x)
        balance = sequence_balance_loss(scores, topk_idx, b, self.n_experts, self.sequence_reduce)
        return y, counts, balance

    def forward(self, x, *w):
        """:meth:`construct`'s math on the weights ``w`` (:meth:`piece_weights`' order), as
        one piece of a layer compiled whole."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        topk_idx, topk_weight, scores = self.gate.forward(flat, w[0], w[1])
        y, counts = self.experts.forward(flat, topk_idx, topk_weight, w[2], w[3], w[4])
        y = y.reshape(b, s, h)
        if self.n_shared:
            y = y + self.shared_experts.forward(x, w[5], w[6], w[7])
        balance = sequence_balance_loss(scores, topk_idx, b, self.n_experts, None)
        return y, counts, balance
