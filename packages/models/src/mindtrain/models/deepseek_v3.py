"""DeepSeek-V3 for causal LM training: HF DeepseekV3ForCausalLM's math and parameter names,
plus the sequence-wise balance loss, aux-loss-free bias update and multi-token prediction."""

from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindtrain.config import ModelConfig, RecomputePlan
from mindtrain.config.plan import MOE_BLOCK
from mindtrain.models import kernels
from mindtrain.models.attention import CoreAttention, plan_causal_blocks
from mindtrain.models.decoder import DecoderLayer
from mindtrain.models.dropout import attach_dropout, token_keys
from mindtrain.models.inputs import shift_left, whole_sequence_inputs
from mindtrain.models.linear import Linear
from mindtrain.models.loss import MaskedCrossEntropy, TokenCrossEntropy
from mindtrain.models.mtp import MTPLayer
from mindtrain.models.norm import RMSNorm, rms_norm
from mindtrain.models.blocks import Block, call_graph, overridden
from mindtrain.models.execution import is_compiled
from mindtrain.models.precision import (DTYPES, check_param_dtype, current_device, resolve_compute_dtype,
                                        to_compute)
from mindtrain.models.rope_cache import rope_and_mask
from mindtrain.models.rope import RotaryEmbedding
from mindtrain.models.weights import Init, new_weight


class Embedding(nn.Cell):
    """``weight [V, H]`` looked up with ops.gather (F.embedding has no CPU kernel)."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float):
        super().__init__()
        self.weight = new_weight((vocab_size, hidden_size), Init("normal", init_std), "weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class DeepseekV3Model(nn.Cell):
    """``embed_tokens``, ``layers`` (decoder layers, then the MTP modules), ``norm``."""

    def __init__(self, cfg: ModelConfig, moe_block: int = MOE_BLOCK):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        layers = [DecoderLayer(cfg, i, moe_block) for i in range(cfg.num_hidden_layers)]
        layers += [MTPLayer(cfg, cfg.num_hidden_layers + k, moe_block) for k in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.CellList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings)


class _HeadLoss(Block):
    """Final norm + lm_head + masked cross-entropy as one cell so it can be one jit graph.
    Holds no parameters of its own (norm and head are passed in). The head matmul runs in
    ``matmul_dtype``; norm and cross-entropy in float32.

    Two hooks let a layout change how it runs without re-implementing it (both eager-only):
    ``sequence_gather`` (None by default) maps the normed hidden states [B, S_local, H] of a
    sequence-parallel rank to [B, S, H] before the head; ``ce.token_loss`` is the per-token
    cross-entropy (see :class:`~mindtrain.models.loss.MaskedCrossEntropy`). A third,
    ``lora_input``, is the head's :meth:`~mindtrain.models.linear.Linear.lora_input` when its
    LoRA adapter has dropout (:func:`mindtrain.models.dropout.attach_lora_dropout` sets it):
    in a training step the head weight comes unmerged, ``[weight, s * B @ A]``, and the normed
    states as ``[x, dropout(x)]`` (before a sequence gather: the masks are the rank's tokens').
    """

    matmul_dtype = None
    fast_kernels = False
    PIECES = ("loss",)

    def __init__(self):
        super().__init__()
        self.ce = MaskedCrossEntropy()
        self.matmul = ops.MatMul(transpose_b=True)
        self.sequence_gather = None
        self.lora_input = None

    def hooks_unset(self) -> bool:
        """True while no layout has set a hook (then the cell can be one graph)."""
        return (self.sequence_gather is None and self.lora_input is None
                and isinstance(self.ce.token_loss, TokenCrossEntropy))

    def piece_weights(self, name: str) -> tuple:
        return ()  # the norm and head weights come as inputs

    def construct(self, h, norm_weight, eps, head_weight, labels, loss_mask):
        graph = self.graph("loss") if self.hooks_unset() else None
        if graph is None:
            return self.loss(h, norm_weight, eps, head_weight, labels, loss_mask)
        return call_graph(graph, h, norm_weight, eps, head_weight, labels, loss_mask)

    def loss(self, h, norm_weight, eps, head_weight, labels, loss_mask):
        """The mean masked cross-entropy of ``h``'s logits."""
        x = h.reshape(-1, h.shape[-1])
        if self.fast_kernels:
            x = kernels.fast_rms_norm(x, norm_weight, eps)
        else:
            x = rms_norm(x, norm_weight, eps)  # the layers' norm (no broadcasting multiplies)
        if self.lora_input is not None:  # [x, dropout(x)] while the head's adapter runs unmerged
            x = self.lora_input(x)
        if self.sequence_gather is not None:
            width = x.shape[-1]
            x = self.sequence_gather(x.reshape(h.shape[:-1] + (width,))).reshape(-1, width)
        cd = self.matmul_dtype
        logits = self.matmul(to_compute(x, cd), to_compute(head_weight, cd))
        if cd is not None:
            logits = ops.cast(logits, ms.float32)
        return self.ce(logits, labels, loss_mask)


class DeepseekV3ForCausalLM(nn.Cell):
    """DeepSeek-V3 causal LM. See the package README for the call conventions.

    ``compute_dtype`` None takes ``cfg.compute_dtype`` with the device's fallback
    (:func:`mindtrain.models.effective_compute_dtype`); a given dtype the device cannot run
    is a ConfigError. Parameters are float32 (``cfg.param_init_dtype``: another dtype is float32
    on CPU, :func:`mindtrain.models.precision.effective_param_dtype`). The fast-kernel
    switch (:mod:`mindtrain.models.kernels`) is read here, once.
    """

    def __init__(self, cfg: ModelConfig, moe_block: int = MOE_BLOCK, compute_dtype: Optional[str] = None):
        super().__init__()
        check_param_dtype(cfg.param_init_dtype, current_device())
        self.compute_dtype = resolve_compute_dtype(cfg.compute_dtype, compute_dtype, current_device())
        self.fast_kernels = kernels.fast_kernels_enabled()
        self.config = cfg
        self.model = DeepseekV3Model(cfg, moe_block)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, init_std=cfg.initializer_range)
        self.head_loss = _HeadLoss()
        self.num_layers = cfg.num_hidden_layers
        self.num_mtp = cfg.num_nextn_predict_layers
        self.moe_layer_ids = [i for i, layer in enumerate(self.model.layers) if layer.is_moe]
        self._expert_load: Optional[Tensor] = None
        self._rope_mask_cache: dict = {}
        self._whole_ends: tuple = ()
        self._configure_cells()
        self.layer_runners: dict = {}
        """Layer index -> what runs it instead of the layer itself (a full-recompute wrapper,
        :func:`mindtrain.models.execution.apply_recompute`), while that wraps the layer now
        in ``model.layers`` (a layout that puts another object there takes over)."""
        self.recompute_plan = RecomputePlan()
        self.recompute_wrappers: dict = {}
        """Every recompute wrapper by what it recomputes ("model.layers.3",
        "model.layers.3.self_attn.core_attention"); their ``forward_calls`` count runs."""

    def _configure_cells(self) -> None:
        """Give every layer that has the attributes the matmul dtype and the kernel choice;
        they must be fixed before a layer's first (possibly compiled) call."""
        matmul_dtype = None if self.compute_dtype == "float32" else DTYPES[self.compute_dtype]
        for _, cell in self.cells_and_names():
            if hasattr(type(cell), "matmul_dtype"):
                cell.matmul_dtype = matmul_dtype
            if hasattr(type(cell), "fast_kernels"):
                cell.fast_kernels = self.fast_kernels
        attach_dropout(self, self.config.attention_dropout, self.config.hidden_dropout)

    # ------------------------------------------------------------------ forward
    def construct(self, input_ids, labels=None, loss_mask=None, position_ids=None, attention_mask=None):
        b, s = input_ids.shape
        if self.dropout.enabled:  # whole sequences here: each token's identity for the dropout masks
            self.dropout.set_tokens(token_keys(input_ids.asnumpy() if isinstance(input_ids, Tensor) else input_ids))
        cos, sin, mask_add = rope_and_mask(self, b, s, position_ids, attention_mask)
        self.plan_attention(mask_add)  # before the whole graph is looked up: its key reads the cores' blocks
        if labels is not None:
            if loss_mask is None:
                loss_mask = ops.ones(labels.shape, ms.float32)
            depths = self.mtp_inputs(input_ids, labels, loss_mask)

        whole = self.whole_graph() if labels is not None else None
        if whole is not None:  # one graph: embedding, decoder layers, head + loss
            lm_loss, counts, balances = call_graph(whole, input_ids, labels, loss_mask, cos, sin, mask_add,
                                                   *self.whole_weights())
            counts, balances = list(counts), list(balances)
        else:
            h = self.embed(input_ids)
            h, counts, balances = self.run_layers(h, range(self.num_layers), cos, sin, mask_add)
            if labels is None:
                return self.logits(h)
            lm_loss = self.lm_loss(h, labels, loss_mask)
        mtp_losses = []
        if self.num_mtp:
            mtp_losses, c, bal = self.mtp_forward(h, depths, cos, sin, mask_add)
            counts += c
            balances += bal
        loss, metrics = self.combine_losses(lm_loss, mtp_losses, balances)
        if counts:
            load = ops.stack([c.astype(ms.float32) for c in counts])
            self._expert_load = load if self._expert_load is None else self._expert_load + load
        return loss, metrics

    # ------------------------------------------------------------------ one graph
    def whole_graph(self):
        """The compiled :meth:`whole_loss` while the training forward may run as one graph, else
        None: every decoder layer runs compiled whole (nothing in it wrapped by a layout, no
        LoRA, no max-logit tracking), the head + loss is compiled with no layout hook, no cell
        of the model has its forward replaced, and there are no MTP modules, recompute or
        dropout. One graph instead of one per layer (and one for the head) saves the
        PyNative hand-offs between them and lets the compiler schedule the whole step (CPU
        time of a bench-size forward + backward, median of 3: 696 against 762 ms; issue 33)."""
        if self.num_mtp or self.layer_runners or self.recompute_wrappers or self.dropout.enabled:
            return None
        head, lm_head = self.head_loss, getattr(self, "lm_head", None)
        if lm_head is None:  # a head tied to the embedding (Qwen3): the per-piece path
            return None
        if "loss" not in head.compiled_pieces or not head.hooks_unset() or lm_head.lora_scaling is not None:
            return None
        layers = tuple(self.model.layers)
        for layer in layers:
            if not (type(layer) is DecoderLayer and "forward" in layer.compiled_pieces and layer.can_run_whole()
                    and not layer.self_attn.track_max_logits):
                return None
        if any(overridden(c) or getattr(c, "lora_scaling", None) is not None for _, c in self.cells_and_names()):
            return None
        return head.graph_cache.model_graph(self, "whole_loss", layers + (head,))

    def whole_weights(self) -> tuple:
        """The Parameters :meth:`whole_loss` takes after its inputs: the embedding, each decoder
        layer's (``piece_weights("forward")``), the final norm's and the head's."""
        weights = [self.model.embed_tokens.weight]
        ends = []
        for layer in self.model.layers:
            weights += layer.piece_weights("forward")
            ends.append(len(weights))
        self._whole_ends = tuple(ends)
        return tuple(weights) + (self.model.norm.weight, self.lm_head.weight)

    def whole_loss(self, input_ids, labels, loss_mask, cos, sin, mask_add, *w):
        """:meth:`construct`'s training forward on the weights ``w`` (:meth:`whole_weights`):
        ``(lm_loss, counts, balances)``, the last two per MoE layer."""
        h = ops.gather(w[0], input_ids, 0)
        counts = ()
        balances = ()
        start = 1
        for i in range(len(self._whole_ends)):
            layer = self.model.layers[i]
            end = self._whole_ends[i]
            h, c, bal = layer.forward(h, cos, sin, mask_add, *w[start:end])
            if layer.is_moe:
                counts = counts + (c,)
                balances = balances + (bal,)
            start = end
        lm_loss = self.head_loss.loss(h, w[-2], self.model.norm.eps, w[-1], labels, loss_mask)
        return lm_loss, counts, balances

    # The pieces ``construct`` is made of. Layouts (pipeline stages, tensor and context
    # parallelism) call these, or swap a hook of the cells they run, instead of repeating them.
    def embed(self, input_ids):
        """Token embeddings [B, S, H] of ``input_ids`` [B, S]."""
        return self.model.embed_tokens(input_ids)

    def rope(self, position_ids):
        """cos, sin [B, 1, S, qk_rope_head_dim] for ``position_ids`` [B, S]."""
        cos, sin = self.model.rotary_emb(position_ids)
        return ops.expand_dims(cos, 1), ops.expand_dims(sin, 1)

    def plan_attention(self, mask_add) -> None:
        """Before layers run on ``mask_add``: the attention cores' causal row blocks
        (:func:`~mindtrain.models.attention.plan_causal_blocks`)."""
        cells = self.__dict__.get("_attentions")
        if cells is None:
            cells = tuple(c for _, c in self.cells_and_names()
                          if isinstance(getattr(c, "core_attention", None), CoreAttention) and isinstance(c, Block))
            object.__setattr__(self, "_attentions", cells)
        plan_causal_blocks(cells, mask_add)

    def run_layers(self, h, layer_ids, cos, sin, mask_add):
        """The decoder layers ``layer_ids`` in order -> ``(h, counts, balances)``: the tokens
        per expert and sequence balance loss of each MoE layer among them."""
        self.plan_attention(mask_add)
        counts, balances = [], []
        for i in layer_ids:
            layer = self.model.layers[i]
            h, c, bal = self._layer(i)(h, cos, sin, mask_add)
            if layer.is_moe:
                counts.append(c)
                balances.append(bal)
        return h, counts, balances

    def _layer(self, i: int):
        layer = self.model.layers[i]
        runner = self.layer_runners.get(i)
        return runner if runner is not None and runner.target is layer else layer

    def logits(self, h):
        """Final norm and lm_head: float32 logits [B, S, V]."""
        logits = self.lm_head(self.model.norm(h))
        return logits if logits.dtype == ms.float32 else ops.cast(logits, ms.float32)

    def lm_loss(self, h, labels, loss_mask):
        """Final norm, lm_head and the masked mean cross-entropy (one cell, ``head_loss``)."""
        norm = self.model.norm
        return self.head_loss(h, norm.weight, norm.eps, self.lm_head.merged_weight(), labels, loss_mask)

    def mtp_inputs(self, input_ids, labels, loss_mask) -> list:
        """Per MTP depth k = 1..num_nextn_predict_layers: ``(input_ids, labels, loss_mask)``
        shifted left by k (:func:`mindtrain.models.inputs.shift_left`), as Tensors."""
        if not self.num_mtp:
            return []
        arrays = [x.asnumpy() if isinstance(x, Tensor) else np.asarray(x) for x in (input_ids, labels, loss_mask)]
        return [tuple(Tensor(shift_left(x, k)) for x in arrays) for k in range(1, self.num_mtp + 1)]

    def mtp_forward(self, h, depths, cos, sin, mask_add):
        """MTP depths 1..len(depths) on the main trunk's last hidden state ``h``;
        ``depths[k - 1]`` is depth k's ``(input_ids, labels, loss_mask)`` (shifted, see
        :meth:`mtp_inputs`). Returns ``(losses per depth, counts, balances)``. Its callers
        (:meth:`construct`, a pipeline stage) ran :meth:`run_layers` on ``mask_add`` first, which
        planned the cores' causal blocks."""
        losses, counts, balances = [], [], []
        for k, (ids_k, labels_k, mask_k) in enumerate(depths, 1):
            layer = self.model.layers[self.num_layers + k - 1]
            h, c, bal = self._layer(self.num_layers + k - 1)(h, self.embed(ids_k), cos, sin, mask_add)
            if layer.is_moe:
                counts.append(c)
                balances.append(bal)
            norm = layer.shared_head.norm
            losses.append(self.head_loss(h, norm.weight, norm.eps, self.lm_head.merged_weight(), labels_k, mask_k))
        return losses, counts, balances

    def combine_losses(self, lm_loss, mtp_losses, balances):
        """The training loss from its parts: ``lm_loss + mtp_loss_scaling_factor *
        mean(mtp_losses) + coefficient * balance``, the family's balance term and its
        coefficient from :meth:`balance_term` (DeepSeek-V3: ``aux_loss_alpha *
        sum(balances)``). Any part may be absent (None / empty): a pipeline stage without the
        head passes only its layers' balances, and (where the balance term is a sum) the
        stages' losses add up to the whole. Returns ``(loss, metrics)``; ``metrics`` has
        ``lm_loss``, ``mtp_loss`` and ``load_balancing_loss`` for the parts present."""
        cfg = self.config
        metrics = {}
        loss = lm_loss
        if lm_loss is not None:
            metrics["lm_loss"] = lm_loss
        if mtp_losses:
            mtp_loss = sum(mtp_losses[1:], mtp_losses[0]) / len(mtp_losses)
            metrics["mtp_loss"] = mtp_loss
            term = cfg.mtp_loss_scaling_factor * mtp_loss
            loss = term if loss is None else loss + term
        if balances:
            balance, coefficient = self.balance_term(balances)
            metrics["load_balancing_loss"] = balance
            if coefficient:
                term = coefficient * balance
                loss = term if loss is None else loss + term
        if loss is None:
            loss = ops.zeros((), ms.float32)
        return loss, metrics

    def balance_term(self, balances):
        """The family's load-balancing loss from its MoE layers' ``balances`` (non-empty) and
        its coefficient in the training loss (0: reported, not added), for
        :meth:`combine_losses`. DeepSeek-V3: the sum of the sequence-wise balance losses,
        ``aux_loss_alpha``."""
        return sum(balances[1:], balances[0]), self.config.aux_loss_alpha

    def whole_sequence_inputs(self, batch, mtp_depths: Optional[int] = None) -> dict:
        """Numpy inputs of whole sequences (see :func:`mindtrain.models.inputs.whole_sequence_inputs`);
        ``mtp_depths`` defaults to the model's. Context parallelism chunks these. In a training
        step with dropout on, ``token_keys`` [B, S] too (:func:`mindtrain.models.dropout.token_keys`)."""
        out = whole_sequence_inputs(batch, self.num_mtp if mtp_depths is None else mtp_depths)
        if self.dropout.enabled:
            out["token_keys"] = token_keys(out["input_ids"])
        return out

    def begin_forward(self, inputs) -> None:
        """Before a forward that runs the model's pieces (a pipeline stage): ``inputs`` is
        that micro-batch's (this rank's part of :meth:`whole_sequence_inputs`)."""
        if self.dropout.enabled:
            self.dropout.set_tokens(inputs.get("token_keys"), inputs.get("whole_token_keys"))

    # ------------------------------------------------------------------ balancing
    def take_expert_load(self) -> Tensor:
        """Tokens routed to each expert since the last call, [num_moe_layers, n_routed_experts]
        (MoE decoder layers, then MTP modules); resets the count."""
        load = self._expert_load
        self._expert_load = None
        if load is None:
            load = Tensor(np.zeros((len(self.moe_layer_ids), self.config.n_routed_experts), np.float32))
        return load

    def update_expert_bias(self, load) -> None:
        """``bias += bias_update_speed * sign(mean(load) - load)`` per MoE layer (aux-loss-free)."""
        speed = self.config.bias_update_speed
        if not speed:
            return
        load = load.asnumpy() if isinstance(load, Tensor) else np.asarray(load)
        load = load.astype(np.float64)
        for row, idx in zip(load, self.moe_layer_ids):
            bias = self.model.layers[idx].mlp.gate.e_score_correction_bias
            new = bias.asnumpy() + speed * np.sign(row.mean() - row)
            ops.assign(bias, Tensor(new.astype(np.float32)))

    # ------------------------------------------------------------------ plan, checkpoints
    def parallel_plan(self) -> dict:
        """See :func:`mindtrain.models.parallel_plan`."""
        from mindtrain.models.parallel_plan import parallel_plan

        return parallel_plan(self)

    def save_pretrained(self, directory: str) -> None:
        """See :func:`mindtrain.models.save_pretrained`."""
        from mindtrain.models.hf_checkpoint import save_pretrained

        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str, **kwargs) -> "DeepseekV3ForCausalLM":
        """See :func:`mindtrain.models.from_pretrained`."""
        from mindtrain.models.hf_checkpoint import from_pretrained

        return from_pretrained(directory, **kwargs)

    def moe_routers(self) -> list:
        """The TopkRouter of every MoE layer (decoder layers, then MTP modules)."""
        return [self.model.layers[i].mlp.gate for i in self.moe_layer_ids]

    def record_routing(self, enabled: bool = True) -> None:
        """Keep each router's top-k expert ids ([T, K] per call) in ``router.recorded``; needs jit off."""
        if enabled and is_compiled(self):
            raise RuntimeError("record_routing needs an eager model (build it with jit=False)")
        for router in self.moe_routers():
            router.recorded = [] if enabled else None

