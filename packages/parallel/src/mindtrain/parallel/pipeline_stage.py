"""One pipeline stage: a contiguous range of the model's units and its forward/backward.

The stage runs the model's own pieces (duck-typed: ``embed``, ``begin_forward``, ``rope``, ``run_layers``,
``lm_loss``, ``mtp_forward``, ``combine_losses``, ``balance_term``; ``config``, ``moe_layer_ids``,
``balance_spans_layers``; see the
causal LM of the models package) on the units of its parallel plan
(:class:`mindtrain.config.plan.ParallelPlan`), so the model's forward and loss rules are written once, in the model. What the stage
adds is the split: the inputs come from :func:`mindtrain.parallel.context_parallel.split_batch`
(MTP targets shifted on the whole sequence, masks for local queries against all keys), and
each loss is this rank's *share* (the shares over CP ranks and stages add up to the
single-process loss).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.config import STEP_FIGURES, StepFigures

METRICS = STEP_FIGURES
"""Order of the per-micro-batch figures a stage returns (each this rank's share): the
fields of :class:`mindtrain.config.StepFigures`."""


class ModelStage:
    """Units ``unit_names`` of ``model`` as one differentiable stage function."""

    def __init__(self, model, plan: dict, unit_names: Sequence[str]):
        self.model = model
        self.cfg = model.config
        by_name = {u["name"]: u for u in plan["units"]}
        self.unit_names = list(unit_names)
        kinds = [by_name[n]["kind"] for n in self.unit_names]
        self.is_first = "embedding" in kinds
        self.is_last = "head" in kinds
        self.decoder_ids = [by_name[n]["layer"] for n in self.unit_names if by_name[n]["kind"] == "decoder"]
        self.mtp_ids = [by_name[n]["layer"] for n in self.unit_names if by_name[n]["kind"] == "mtp"]
        owned = [p for n in self.unit_names for p in by_name[n]["params"]]
        # weights of other units this stage also uses (the plan's shared weights: MTP modules
        # use the embedding and the head)
        self.shared = [p for p, users in plan.get("shared", {}).items()
                       if p not in owned and any(u in self.unit_names for u in users)]
        named = dict((p.name, p) for p in model.get_parameters())
        self.param_names = [n for n in owned + self.shared if named[n].requires_grad]
        self.params = [named[n] for n in self.param_names]
        self.moe_rows = {layer: row for row, layer in enumerate(model.moe_layer_ids)}
        self.num_heads = self.cfg.num_attention_heads
        self.hidden_size = self.cfg.hidden_size
        self.activation = tuple(plan.get("activation") or ()) or (self.hidden_size,)
        """The per-token shape of the hidden states a stage sends on (the plan's ``activation``)."""
        self.num_experts = int(self.cfg.n_routed_experts or 0)
        self.spans = bool(getattr(model, "balance_spans_layers", False)) and bool(self.moe_rows)
        """Whether the model's balance loss spans every MoE layer (see :meth:`forward`)."""

    # ---------------------------------------------------------------- forward
    def forward(self, h, mb: dict, carried=None, total=None) -> tuple:
        """``(out, loss, figures [4], counts [n_moe_layers_here, E], carry)``: ``out`` is the
        hidden state for the next stage, or this stage's loss share on the last stage; ``loss``
        this stage's part of the training loss (the model's ``combine_losses`` of what it holds:
        on other stages its layers' aux loss). ``h`` is ignored on the first stage.

        A model whose balance loss spans all its MoE layers (``balance_spans_layers``, e.g.
        HF's Qwen3-MoE loss, one product over every layer's tokens) does not split into
        per-stage sums; its stages pass the balance terms along. ``carried`` [2, E]: the terms
        of the earlier stages (forward messages); ``total`` [E]: the routing counts of the
        whole model (backward messages). The last stage reports the whole balance loss (its
        own terms plus ``carried``); an earlier stage reports none but, given ``total``, adds
        the gradient of its own terms (a zero-valued term). ``carry``: what this stage sends
        on, detached: the terms so far [2, E] (not the last stage) or the total counts [E]
        (the last stage); None for other models."""
        model = self.model
        begin = getattr(model, "begin_forward", None)
        if begin is not None:  # per micro-batch state of the model's forward (its dropout tokens)
            begin(mb)
        # what the layers read beside the hidden states and the ids the model keeps from
        # ``begin_forward`` (e.g. the token ids a hash router reads): rope and the mask
        context = (*model.rope(mb["position_ids"]), mb["mask_add"])
        if self.is_first:
            h = model.embed(mb["input_ids"])
        h, counts, balances = model.run_layers(h, self.decoder_ids, *context)
        lm, mtp_losses = None, []
        if self.is_last:
            lm = model.lm_loss(h, mb["labels"], mb["loss_mask"]) * mb["lm_scale"]
            if self.mtp_ids:
                depths = [(t["input_ids"], t["labels"], t["loss_mask"]) for t in mb["mtp"]]
                losses, c, bal = model.mtp_forward(h, depths, *context)
                mtp_losses = [loss_k * t["scale"] for loss_k, t in zip(losses, mb["mtp"])]
                counts += c
                balances += bal
        carry, gradient_only = None, None
        if self.spans:
            balances, carry, gradient_only = self._spanning_balance(balances, carried, total)
        loss, metrics = model.combine_losses(lm, mtp_losses, balances)
        figures = ops.stack(list(StepFigures.from_model(loss, metrics, ops.zeros((), ms.float32))))
        if gradient_only is not None:
            loss = loss + gradient_only
        count = ops.stack([c.astype(ms.float32) for c in counts]) if counts else ops.zeros((0,), ms.float32)
        return (loss if self.is_last else h), loss, figures, count, carry

    def _spanning_balance(self, balances, carried, total):
        """(the balances this stage reports, its carry, a zero-valued term carrying the gradient
        of its own balance terms or None); see :meth:`forward`."""
        e = self.num_experts
        own = None
        for b in balances:
            own = b if own is None else own + b
        so_far = carried if carried is not None else ops.zeros((2, e), ms.float32)
        if own is not None:
            so_far = so_far + ops.stop_gradient(own)
        if self.is_last:
            reported = ([carried] if carried is not None else []) + list(balances)
            return reported, ops.stop_gradient(so_far[0]), None
        extra = None
        if total is not None and own is not None:
            # the whole loss is linear in this stage's probabilities once every count is known:
            # the rest of the counts beside this stage's own, no probabilities
            rest = ops.concat((ops.stop_gradient(total - own[0]).reshape(1, e), ops.zeros((1, e), ms.float32)), 0)
            value, coefficient = self.model.balance_term([rest] + list(balances))
            if coefficient:
                term = coefficient * value
                extra = term - ops.stop_gradient(term)
        return [], ops.stop_gradient(so_far), extra

    # ---------------------------------------------------------------- autodiff
    def _objective(self, h, sens, mb, carried, total):
        out, loss, figures, count, carry = self.forward(h, mb, carried, total)
        if self.is_last:
            obj = loss
        else:
            # d/dθ sum(out * sens) is the vector-Jacobian product with the next stage's gradient
            obj = (out * sens).sum() + loss
        return obj, (ops.stop_gradient(out), figures, count, carry if carry is not None else ops.zeros((0,)))

    def forward_only(self, h, mb: dict, carried=None):
        """``(out, carry)``: the stage output without recording a graph (sent ahead; the
        backward recomputes it) and what the model's balance terms carry on (or None)."""
        with ms._no_grad():
            out, _, _, _, carry = self.forward(h, mb, carried)
        return out, carry

    def backward(self, h, sens, mb: dict, carried=None, total=None):
        """Recompute the forward and return ``(grad of h or None, param grads, figures, counts,
        carry)`` (``carry``: the total routing counts to send back, see :meth:`forward`)."""
        wants_h = not self.is_first
        if h is None:
            h = ops.zeros((1,), ms.float32)
        if sens is None:
            sens = ops.zeros((1,), ms.float32)
        fn = _grad_fn(self, wants_h)
        if wants_h:
            (_, (_, figures, count, carry)), (gh, grads) = fn(h, sens, mb, carried, total)
        else:
            (_, (_, figures, count, carry)), grads = fn(h, sens, mb, carried, total)
            gh = None
        if not self.spans:
            carry = None
        elif not self.is_last:
            carry = total
        return gh, list(grads), figures, count, carry

    def message_extra(self, backward: bool) -> int:
        """Floats a message between stages carries beyond the activation (or its gradient):
        the balance terms [2, E] forward, the total counts [E] backward, for a model whose
        balance spans its layers; else 0."""
        return (self.num_experts if backward else 2 * self.num_experts) if self.spans else 0

    def load_rows(self, count) -> Tensor:
        """This stage's counts placed in the model's [n_moe_layers, E] expert-load matrix."""
        n_rows = len(self.moe_rows)
        e = int(self.cfg.n_routed_experts)
        out = np.zeros((n_rows, e), np.float32)
        layers = [i for i in self.decoder_ids + self.mtp_ids if i in self.moe_rows]
        if layers:
            c = count.asnumpy().reshape(len(layers), e)
            for row, layer in zip(c, layers):
                out[self.moe_rows[layer]] = row
        return Tensor(out)


def _grad_fn(stage: ModelStage, wants_h: bool):
    key = "_grad_h" if wants_h else "_grad"
    fn = getattr(stage, key, None)
    if fn is None:
        fn = ms.value_and_grad(stage._objective, 0 if wants_h else None, stage.params, has_aux=True)
        setattr(stage, key, fn)
    return fn
