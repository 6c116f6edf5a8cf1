"""DeepSeek-V4's mixture of experts (HF DeepseekV4SparseMoeBlock): a router scoring experts
with ``scoring_func`` (sqrt(softplus) or sigmoid), choosing them by a learned top-k with a
correction bias (:class:`ScoreTopkRouter`) or, in the first ``num_hash_layers`` layers, by a
fixed token -> experts table (:class:`HashRouter`); routed experts and one shared expert with
the clamped SwiGLU (``swiglu_limit``). The routed experts are the package's
:class:`~mindtrain.models.experts.RoutedExperts` (stacked; files hold per-expert tensors)."""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from mindtrain.config.plan import MOE_BLOCK, Region
from mindtrain.models.experts import RoutedExperts
from mindtrain.models.linear import linear
from mindtrain.models.mlp import MLP
from mindtrain.models.moe import sequence_balance_loss
from mindtrain.models.router import _RANK_LIMIT, _topk_indices_by_rank
from mindtrain.models.weights import Init, new_weight


def expert_scores(logits, scoring_func: str):
    """Each expert's score from its router logit: ``sqrt(softplus(x))`` or ``sigmoid(x)``."""
    if scoring_func == "sigmoid":
        return ops.sigmoid(logits)
    return ops.sqrt(ops.softplus(logits))


class _Router(nn.Cell):
    matmul_dtype = None

    def __init__(self, cfg):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.scoring_func = cfg.scoring_func
        self.scaling = float(cfg.routed_scaling_factor)
        self.weight = new_weight((self.n_experts, cfg.hidden_size), Init("normal", cfg.initializer_range), "weight")
        self.recorded = None  # a list while the model's record_routing(True) is on

    def _weights(self, scores, topk_idx):
        topk_idx = ops.stop_gradient(topk_idx)
        w = ops.gather_elements(scores, 1, topk_idx)
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
        if self.recorded is not None:
            self.recorded.append(topk_idx)
        return topk_idx, w * self.scaling, scores


class ScoreTopkRouter(_Router):
    """HF DeepseekV4TopKRouter: ``weight [E, H]``, ``e_score_correction_bias [E]`` (moved by
    the aux-loss-free update, not by gradients). ``construct(x [T, H], ids)`` -> (topk_idx
    [T, K] int32, weights [T, K] (normalised, times routed_scaling_factor), scores [T, E])."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.e_score_correction_bias = new_weight((self.n_experts,), Init("zeros"), "e_score_correction_bias",
                                                  requires_grad=False)

    def construct(self, x, ids):
        scores = expert_scores(linear(x, self.weight, None, self.matmul_dtype), self.scoring_func)
        choice = ops.stop_gradient(scores) + self.e_score_correction_bias
        if self.n_experts <= _RANK_LIMIT:
            topk_idx = _topk_indices_by_rank(choice, self.top_k)
        else:
            _, topk_idx = ops.topk(choice, self.top_k)
        return self._weights(scores, topk_idx.astype(ms.int32))


class HashRouter(_Router):
    """HF DeepseekV4HashRouter: ``weight [E, H]`` scores the experts, ``tid2eid [V, K]`` (a
    fixed table, float-stored ids, not trained) chooses them by token id."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.tid2eid = new_weight((cfg.vocab_size, self.top_k), Init("hash", modulus=self.n_experts), "tid2eid",
                                  requires_grad=False)

    def construct(self, x, ids):
        scores = expert_scores(linear(x, self.weight, None, self.matmul_dtype), self.scoring_func)
        topk_idx = ops.gather(self.tid2eid, ids.reshape(-1).astype(ms.int32), 0).astype(ms.int32)
        return self._weights(scores, topk_idx)


class DeepseekV4MoE(nn.Cell):
    """``gate`` (hash or learned), ``experts`` and ``shared_experts``. ``construct(x [B,S,H],
    ids [B,S])`` -> (y [B,S,H], tokens per expert [E], balance loss). The balance loss is zero
    while ``aux_loss_alpha`` is 0 (HF's V4 adds none); otherwise MindFormers' V4
    ``seq_aux_loss``: DeepSeek-V3's sequence-wise loss over the normalised scores, with the
    experts taken as the top-k of the scores (no correction bias, hash-routed layers
    included: Megatron's auxiliary-loss indices, not the routed ones)."""

    # its region in the parallel plan (mindtrain.models.parallel_plan): the token ids follow the
    # hidden states (the hash router reads them; a sequence shard routes its own tokens' ids)
    REGION = Region.declare("moe", token_args=1)

    def __init__(self, cfg, hashed: bool, block: int = MOE_BLOCK):
        super().__init__()
        std = cfg.initializer_range
        self.hashed = hashed
        self.n_experts = cfg.n_routed_experts
        self.gate = HashRouter(cfg) if hashed else ScoreTopkRouter(cfg)
        limit = float(cfg.swiglu_limit)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, init_std=std,
                                     block=block, swiglu_limit=limit)
        self.n_shared = cfg.n_shared_experts
        if self.n_shared:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * self.n_shared, init_std=std,
                                      swiglu_limit=limit)
        self.sequence_reduce = None
        self.balanced = bool(cfg.aux_loss_alpha)

    def shared_output(self, x):
        return self.shared_experts(x) if self.n_shared else None

    def sharded_balance(self, scores, topk_idx, counts, batch: int, seq: int, sum_counts, sum_scores):
        """The balance term on a sequence shard (tensor parallelism): HF's V4 adds none."""
        return ops.zeros((), ms.float32)

    def construct(self, x, ids):
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        topk_idx, topk_weight, scores = self.gate(flat, ids)
        y, counts = self.experts(flat, topk_idx, topk_weight)
        y = y.reshape(b, s, h)
        if self.n_shared:
            y = y + self.shared_experts(x)
        if not self.balanced:
            return y, counts, ops.zeros((), ms.float32)
        _, top = ops.topk(ops.stop_gradient(scores), self.gate.top_k)
        return y, counts, sequence_balance_loss(scores, top.astype(ms.int32), b, self.n_experts, self.sequence_reduce)
