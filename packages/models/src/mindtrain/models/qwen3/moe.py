"""Qwen3-MoE's sparse block: a softmax top-k router over routed experts (no shared experts, no
correction bias), and HF's load-balancing loss."""

from __future__ import annotations

from mindspore import ops

from mindtrain.config.plan import MOE_BLOCK, Region
from mindtrain.models.blocks import Block
from mindtrain.models.experts import RoutedExperts
from mindtrain.models.router import _RANK_LIMIT, _topk_indices_by_rank
from mindtrain.models.softmax import Softmax
from mindtrain.models.weights import Init, new_weight


class SoftmaxTopkRouter(Block):
    """HF Qwen3MoeTopKRouter: ``weight [E, H]``; ``construct(x [T, H])`` -> (topk_idx [T, K]
    int32, topk_weight [T, K], probs [T, E]): softmax over the experts' logits, the K largest
    probabilities as the routing weights, divided by their sum when ``norm_topk_prob``."""

    PIECES = ("forward",)

    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = bool(cfg.norm_topk_prob)
        self.weight = new_weight((self.n_experts, cfg.hidden_size), Init("normal", cfg.initializer_range), "weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.softmax = Softmax()
        # a list while the model's record_routing(True) is on (eager only)
        self.recorded = None

    def piece_weights(self, name: str) -> tuple:
        return (self.weight,)

    def construct(self, x):
        out = self.run("forward", x)
        if self.recorded is not None:
            self.recorded.append(out[0])
        return out

    def forward(self, x, weight):
        """Routing of ``x`` [T, H] with the router ``weight``."""
        probs = self.softmax(self.matmul(x, weight))
        if self.n_experts <= _RANK_LIMIT:
            topk_idx = _topk_indices_by_rank(probs, self.top_k)
        else:
            _, topk_idx = ops.topk(probs, self.top_k)
        topk_idx = ops.stop_gradient(topk_idx)
        weights = ops.gather_elements(probs, 1, topk_idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        return topk_idx, weights, probs


def balance_terms(counts, probs, sequence_reduce=None):
    """A MoE layer's share of HF's load-balancing loss: [2, E] = (tokens routed to each expert
    (no gradient), the sum of each expert's routing probability over the tokens).

    ``sequence_reduce`` (context parallelism: this rank holds part of every sequence) sums the
    counts over the ranks sharing the sequences; the probabilities stay this rank's. The
    loss is linear in the probabilities once the counts are fixed, so each rank's
    :func:`load_balancing_loss` is then its share, and the shares add up to the loss of the
    whole micro-batch."""
    return _terms(counts, probs.sum(0), sequence_reduce)


def _terms(counts, prob_sums, sequence_reduce=None):
    e = prob_sums.shape[-1]
    counts = ops.stop_gradient(counts).astype(prob_sums.dtype).reshape(1, e)
    if sequence_reduce is not None:
        counts, _ = sequence_reduce(counts, 1)
        counts = ops.stop_gradient(counts)
    return ops.concat((counts, prob_sums.reshape(1, e)), 0)


def load_balancing_loss(balances: list, top_k: int):
    """HF's ``load_balancing_loss_func`` (Switch Transformer eq. 4-6 as transformers 5.x
    computes it for Qwen3-MoE) from the MoE layers' :func:`balance_terms`: the tokens of all
    layers together, ``E * sum_e f_e P_e`` with ``f_e`` = assignments to e / rows and ``P_e``
    = mean routing probability of e (rows = tokens x layers; no padding mask)."""
    total = balances[0]
    for b in balances[1:]:
        total = total + b
    counts, probs = total[0], total[1]
    rows = counts.sum() / top_k
    return counts.shape[0] * ((counts / rows) * (probs / rows)).sum()


class Qwen3MoE(Block):
    """HF Qwen3MoeSparseMoeBlock: ``gate`` (:class:`SoftmaxTopkRouter`) and ``experts``
    (:class:`~mindtrain.models.experts.RoutedExperts`, stacked; files hold HF's per-expert
    ``experts.{e}.gate_proj.weight`` ...). ``construct(x [B,S,H])`` -> (y [B,S,H], tokens per
    expert [E], :func:`balance_terms` [2, E])."""

    REGION = Region.declare("moe")  # its region in the parallel plan (mindtrain.models.parallel_plan)

    def __init__(self, cfg, block: int = MOE_BLOCK):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.gate = SoftmaxTopkRouter(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     init_std=cfg.initializer_range, block=block)
        self.sequence_reduce = None  # context parallelism: sums the routing counts over the CP group

    def shared_output(self, x):
        """None: Qwen3-MoE has no shared experts (for a layout that runs the routed part itself)."""
        return None

    def sharded_balance(self, probs, topk_idx, counts, batch: int, seq: int, sum_counts, sum_scores):
        """:func:`balance_terms` when this rank routed one shard of every sequence (tensor
        parallelism's sequence shards): ``counts`` [E] are the experts' token counts of the
        whole sequences (the layout made them whole); the local ``probs`` [T, E] are summed
        over the shards by ``sum_scores`` (forward all-reduce, backward identity: each rank's
        gradient stays its own tokens'). ``sum_counts`` is not needed."""
        return _terms(counts, sum_scores(probs.sum(0)), self.sequence_reduce)

    def piece_weights(self, name: str) -> tuple:
        return self.gate.piece_weights("forward") + self.experts.piece_weights("forward")

    def construct(self, x):
        """Through the sub-cells (each may be compiled, or wrapped by a layout)."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        topk_idx, topk_weight, probs = self.gate(flat)
        y, counts = self.experts(flat, topk_idx, topk_weight)
        return y.reshape(b, s, h), counts, balance_terms(counts, probs, self.sequence_reduce)

    def forward(self, x, *w):
        """:meth:`construct`'s math on the weights ``w`` (:meth:`piece_weights`' order), as
        one piece of a layer compiled whole."""
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        topk_idx, topk_weight, probs = self.gate.forward(flat, w[0])
        y, counts = self.experts.forward(flat, topk_idx, topk_weight, w[1], w[2], w[3])
        return y.reshape(b, s, h), counts, balance_terms(counts, probs)


__all__ = ["Qwen3MoE", "SoftmaxTopkRouter", "balance_terms", "load_balancing_loss"]
