"""One pipeline stage: a contiguous range of the model's units and its forward/backward.

The stage runs the model's own pieces (duck-typed: ``embed``, ``rope``, ``run_layers``,
``lm_loss``, ``mtp_forward``, ``combine_losses``; ``config``, ``moe_layer_ids``; see the
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

    # ---------------------------------------------------------------- forward
    def forward(self, h, mb: dict) -> tuple:
        """``(out, loss, figures [4], counts [n_moe_layers_here, E])``: ``out`` is the hidden
        state for the next stage, or this stage's loss share on the last stage; ``loss`` this
        stage's part of the training loss (the model's ``combine_losses`` of what it holds:
        on other stages its layers' aux loss). ``h`` is ignored on the first stage."""
        model = self.model
        cos, sin = model.rope(mb["position_ids"])
        mask = mb["mask_add"]
        if self.is_first:
            h = model.embed(mb["input_ids"])
        h, counts, balances = model.run_layers(h, self.decoder_ids, cos, sin, mask)
        lm, mtp_losses = None, []
        if self.is_last:
            lm = model.lm_loss(h, mb["labels"], mb["loss_mask"]) * mb["lm_scale"]
            if self.mtp_ids:
                depths = [(t["input_ids"], t["labels"], t["loss_mask"]) for t in mb["mtp"]]
                losses, c, bal = model.mtp_forward(h, depths, cos, sin, mask)
                mtp_losses = [loss_k * t["scale"] for loss_k, t in zip(losses, mb["mtp"])]
                counts += c
                balances += bal
        loss, metrics = model.combine_losses(lm, mtp_losses, balances)
        figures = ops.stack(list(StepFigures.from_model(loss, metrics, ops.zeros((), ms.float32))))
        count = ops.stack([c.astype(ms.float32) for c in counts]) if counts else ops.zeros((0,), ms.float32)
        return (loss if self.is_last else h), loss, figures, count

    # ---------------------------------------------------------------- autodiff
    def _objective(self, h, sens, mb):
        out, loss, figures, count = self.forward(h, mb)
        if self.is_last:
            obj = loss
        else:
            # d/dθ sum(out * sens) is the vector-Jacobian product with the next stage's gradient
            obj = (out * sens).sum() + loss
        return obj, (ops.stop_gradient(out), figures, count)

    def forward_only(self, h, mb: dict):
        """The stage output without recording a graph (sent ahead; the backward recomputes it)."""
        with ms._no_grad():
            out, _, _, _ = self.forward(h, mb)
        return out

    def backward(self, h, sens, mb: dict):
        """Recompute the forward and return ``(grad of h or None, param grads, figures, counts)``."""
        wants_h = not self.is_first
        if h is None:
            h = ops.zeros((1,), ms.float32)
        if sens is None:
            sens = ops.zeros((1,), ms.float32)
        fn = _grad_fn(self, wants_h)
        if wants_h:
            (_, (_, figures, count)), (gh, grads) = fn(h, sens, mb)
        else:
            (_, (_, figures, count)), grads = fn(h, sens, mb)
            gh = None
        return gh, list(grads), figures, count

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
