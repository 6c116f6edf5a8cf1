"""Muon (``optimizer.type: Muon``) as MindFormers' PyNative Muon computes it.

Per Muon parameter (every 2-D weight, every stacked ``[E, rows, cols]`` expert weight, save
those ``adamw_include`` names)::

    m      = momentum * m + g                       (MindFormers' buffer; torch keeps (1 - momentum) * m)
    x      = g + momentum * m   (nesterov)  or  m
    x      = NS(x)   per matrix (per expert), MLA's fused matrices per logical part,
                     the lora_b parts of a LoRA-adapted fused layer as one matrix
    p      = p * (1 - lr * weight_decay) - lr * matched_adamw_rms * sqrt(max(rows, cols)) * x

LoRA (MindFormers' optimizer holds only the adapters): a layer MindFormers fuses
(``linear_qkv``, ``linear_fc1``) is several layers here sharing one ``lora_a``, each with its
rows of ``lora_b``; MindFormers' fused ``lora_b`` [sum(out), r] is one parameter and one matrix
for its Newton-Schulz, so the parts' ``lora_b`` are orthogonalised stacked, as one
(:func:`mindtrain.trainer.muon_rules.muon_matrix`; scale ``sqrt(max(sum(out), r))``), the
shared ``lora_a`` once.

``NS`` is the Newton-Schulz iteration with the coefficient schedule (X / (||X||_F + eps), then
per step ``A = X X^T; X = a X + (b A + c A A) X``, on the wide orientation). Everything else
(norms, biases, the embedding and the LM head by default) is updated by :class:`AdamW` with
``adamw_betas`` / ``adamw_eps``.

Distributed: the optimizer holds this rank's pieces (FSDP dim-0 shards with padding, TP
slices, EP experts). Newton-Schulz needs whole matrices, so when any Muon parameter is split
the Newton-Schulz inputs are gathered whole with the layout's ``gather_own``, a batch of at
most :data:`GATHER_BYTES` at a time (a collective over the groups that hold the pieces, never
across pipeline stages), every rank runs Newton-Schulz on the whole matrices, and keeps its own
piece with ``scatter_own`` (no communication; padding rows zero). Same as MindFormers' default
``comm_strategy: allgather`` and Moonlight's Distributed Muon.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from mindspore import Parameter, Tensor, ops

from mindtrain.config import OptimizerConfig
from mindtrain.trainer import muon_rules
from mindtrain.trainer.muon_rules import GATHER_BYTES
from mindtrain.trainer.optimizer import AdamW, wants_decay

MOMENTUM = "muon_m"
_QK_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$")


def newton_schulz(x: Tensor, schedule: Sequence[tuple[float, float, float]], eps: float) -> Tensor:
    """Newton-Schulz orthogonalisation of the last two dims of ``x`` ([rows, cols] or
    [batch, rows, cols]; each matrix on its own), as MindFormers' ``newton_schulz``."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.swapaxes(-2, -1)
    norm = ops.sqrt((x * x).sum(axis=(-2, -1), keepdims=True))
    x = x / (norm + eps)
    for a, b, c in schedule:
        gram = ops.matmul(x, x.swapaxes(-2, -1))
        poly = b * gram + c * ops.matmul(gram, gram)
        x = a * x + ops.matmul(poly, x)
    if tall:
        x = x.swapaxes(-2, -1)
    return x


def _periodic(part_a: int, part_b: int, groups: int) -> list[np.ndarray]:
    """Rows of a ``[A, B] * groups`` layout: every group's first ``part_a``, then its ``part_b``."""
    base = np.arange(groups)[:, None] * (part_a + part_b)
    return [(base + np.arange(part_a)).reshape(-1), (base + part_a + np.arange(part_b)).reshape(-1)]


def muon_parts(name: str, rows: int, model: Any, mla: bool) -> Optional[list[np.ndarray]]:
    """The logical matrices (row indices) MindFormers orthogonalises separately inside one
    of mindtrain's MLA weights (its ``make_model_muon_fns`` schema, on mindtrain's unfused
    tensors): None when the weight is one matrix. MindFormers' fused ``linear_fc1`` (gate,
    up) and ``linear_qkv`` (q, kv) are separate tensors here already."""
    if model is None or not mla:
        return None
    heads, nope, rope, v = (model.num_attention_heads, model.qk_nope_head_dim, model.qk_rope_head_dim,
                            model.v_head_dim)
    if name.endswith("self_attn.q_b_proj.weight") or (name.endswith("self_attn.q_proj.weight")):
        parts = _periodic(nope, rope, heads)
    elif name.endswith("self_attn.kv_b_proj.weight"):
        parts = _periodic(nope, v, heads)
    elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        parts = [np.arange(model.kv_lora_rank), model.kv_lora_rank + np.arange(rope)]
    else:
        return None
    return parts if sum(len(p) for p in parts) == rows else None


def uses_muon(name: str, shape: Sequence[int], cfg: OptimizerConfig, model: Any = None) -> bool:
    """:func:`mindtrain.trainer.muon_rules.uses_muon` with ``cfg.adamw_include`` (``model``:
    ``cfg.model``, whose family's full name map MindFormers' names come from)."""
    return muon_rules.uses_muon(name, shape, cfg.adamw_include, model)


class Muon:
    """Muon for the matrices, AdamW for the rest; the interface of :class:`AdamW`.

    ``layout`` (a :class:`mindtrain.parallel.Layout`) gives each piece's place in its full
    array (``shards``) and the gather (``gather_own`` / ``scatter_own``); None: the parameters are
    whole. ``model`` (``cfg.model``) names MindFormers' tensors for ``adamw_include`` and
    sizes MLA's logical parts.
    """

    def __init__(self, named_params: Sequence[tuple[str, Parameter]], cfg: OptimizerConfig, lr: float,
                 layout: Any = None, model: Any = None):
        from mindtrain.config.validate import ns_schedule

        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.lr = float(lr)
        self.weight_decay = float(cfg.weight_decay)
        self.momentum = float(cfg.momentum)
        self.nesterov = bool(cfg.nesterov)
        self.schedule = ns_schedule(cfg)
        self.eps = float(cfg.eps)
        self.rms = float(cfg.matched_adamw_rms)
        self.layout = layout
        self.model = model
        shards = None
        if layout is not None:  # aligned with named_params (a subset of the layout's: LoRA's adapters)
            where = dict(zip([n for n, _ in layout.named_params], layout.shards()))
            shards = [where[n] for n in self.names]
        self.global_shapes = ([tuple(s.global_shape) for s in shards] if shards is not None
                              else [tuple(p.shape) for p in self.params])
        mla = any(n.endswith("kv_a_proj_with_mqa.weight") for n in self.names)
        self.use_muon = [uses_muon(n, s, cfg, model) for n, s in zip(self.names, self.global_shapes)]
        self.muon_idx = [i for i, u in enumerate(self.use_muon) if u]
        self.adamw_idx = [i for i, u in enumerate(self.use_muon) if not u]
        self.parts = {i: muon_parts(self.names[i], self.global_shapes[i][-2], model, mla) for i in self.muon_idx}
        self.decay = [wants_decay(n, p) for n, p in named_params]
        named_adamw = [named_params[i] for i in self.adamw_idx]
        self.adamw = AdamW(named_adamw, lr=lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps,
                           weight_decay=cfg.weight_decay,
                           no_decay={n for n, p in named_adamw if not wants_decay(n, p)})
        self.muon_m = [Parameter(Tensor(np.zeros(self.params[i].shape, np.float32)),
                                 name=f"{MOMENTUM}.{self.params[i].name}", requires_grad=False)
                       for i in self.muon_idx]
        # whole matrices here, or pieces to gather (every rank of a layout decides alike)
        self.gather = shards is not None and any(
            tuple(shards[i].shape) != self.global_shapes[i] or tuple(self.params[i].shape) != self.global_shapes[i]
            for i in self.muon_idx)
        # Newton-Schulz's matrices: each Muon parameter, save the lora_b parts of a layer
        # MindFormers fuses, which are one matrix (muon_rules.muon_matrix), in parameter order
        where_group: dict[str, list[int]] = {}
        for i in self.muon_idx:
            where_group.setdefault(muon_rules.muon_matrix(self.names[i], model), []).append(i)
        self.groups: list[list[int]] = list(where_group.values())
        # the gathers' batches: whole groups in order, up to GATHER_BYTES of whole arrays each
        # (a larger group alone); every rank of a stage makes the same batches
        self.batches: list[list[int]] = []
        size = 0
        for group in self.groups:
            n = sum(4 * int(np.prod(self.global_shapes[i])) for i in group)
            if not self.batches or size + n > GATHER_BYTES:
                self.batches.append([])
                size = 0
            self.batches[-1].extend(group)
            size += n
        self.step_count = 0

    @classmethod
    def from_config(cls, named_params, cfg: OptimizerConfig, lr: float, layout: Any = None,
                    model: Any = None) -> "Muon":
        return cls(named_params, cfg, lr, layout=layout, model=model)

    # ------------------------------------------------------------------ update
    def _orthogonalise_all(self, whole: Mapping[int, Tensor]) -> dict[int, Tensor]:
        """lr-free updates of the Muon parameters in ``whole`` (whole Newton-Schulz inputs, by
        index; only complete groups): a fused layer's ``lora_b`` parts as ONE matrix, their rows
        stacked (Newton-Schulz commutes with a row permutation, so MindFormers' row order of the
        fused tensor gives the same rows), scaled by ``sqrt(max(sum(rows), r))``; the rest each
        on its own (:meth:`_orthogonalise`)."""
        out = {}
        for group in self.groups:
            if group[0] not in whole:
                continue
            if len(group) == 1:
                out[group[0]] = self._orthogonalise(group[0], whole[group[0]])
                continue
            xs = [whole[i] for i in group]
            rows = [int(x.shape[0]) for x in xs]
            fused = newton_schulz(ops.cat(xs, 0), self.schedule, self.eps)
            fused = fused * (self.rms * math.sqrt(max(sum(rows), int(xs[0].shape[-1]))))
            for i, piece in zip(group, ops.split(fused, rows, 0)):
                out[i] = piece
        return out

    def _orthogonalise(self, i: int, x: Tensor) -> Tensor:
        """lr-free update of Muon parameter ``i`` from its whole Newton-Schulz input."""
        parts = self.parts[i]
        if parts is None:
            rows, cols = x.shape[-2:]
            return newton_schulz(x, self.schedule, self.eps) * (self.rms * math.sqrt(max(rows, cols)))
        cols = x.shape[-1]
        order = np.concatenate(parts)
        inverse = Tensor(np.argsort(order).astype(np.int32))
        pieces = []
        for rows in parts:
            piece = ops.gather(x, Tensor(rows.astype(np.int32)), x.ndim - 2)
            scale = self.rms * math.sqrt(max(len(rows), cols))
            pieces.append(newton_schulz(piece, self.schedule, self.eps) * scale)
        return ops.gather(ops.cat(pieces, x.ndim - 2), inverse, x.ndim - 2)

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None, grad_scale: float = 1.0) -> None:
        """One update with ``grads`` (aligned with the parameters) multiplied by ``grad_scale``
        (the clipping coefficient, in (0, 1]); ``lr`` overrides self.lr."""
        if lr is not None:
            self.lr = float(lr)
        self.step_count += 1
        mu = self.momentum
        inputs = {}
        for i, m in zip(self.muon_idx, self.muon_m):
            g = grads[i].astype(m.dtype) if grads[i].dtype != m.dtype else grads[i]
            if grad_scale != 1.0:
                g = g * grad_scale
            next_m = m * mu + g
            ops.assign(m, next_m)
            inputs[i] = g + next_m * mu if self.nesterov else next_m
        if self.gather:
            # whole matrices a bounded batch at a time, gathered over the groups holding their
            # pieces (never the whole model, never across pipeline stages)
            local_updates = {}
            for batch in self.batches:
                full = self.layout.gather_own([(self.names[i], inputs[i]) for i in batch])
                done = self._orthogonalise_all({i: Tensor(full.pop(self.names[i])) for i in batch})
                updates = {self.names[i]: done[i].asnumpy() for i in batch}
                local_updates.update(zip(batch, self.layout.scatter_own(updates)))
        else:
            local_updates = self._orthogonalise_all(inputs)
        for i in self.muon_idx:
            p = self.params[i]
            keep = 1.0 - self.lr * self.weight_decay if self.decay[i] else 1.0
            u = local_updates[i]
            ops.assign(p, p * keep - (u if u.dtype == p.dtype else u.astype(p.dtype)) * self.lr)
        self.adamw.step([grads[i] for i in self.adamw_idx], lr=self.lr, grad_scale=grad_scale)

    # ------------------------------------------------------------------ QK-clip
    def qk_clip(self, max_logits: Mapping[int, np.ndarray], threshold: float) -> int:
        """MindFormers' QK-clip (``Muon.qk_clip_enabled``), after the update: every MLA head
        whose max pre-softmax logit of the step (``max_logits``: ``{layer: [heads]}``, all
        ranks', :func:`mindtrain.trainer.max_logits.synced_max_logits`) reaches
        ``threshold`` gets ``scale = threshold / max_logit``; its query weights' ``nope`` rows
        are multiplied by ``sqrt(scale)`` and its ``rope`` rows by ``scale`` (``q_b_proj``, or
        ``q_proj`` without a query LoRA), its key ``nope`` rows of ``kv_b_proj`` by
        ``sqrt(scale)``; the values and the shared rope key (``kv_a_proj_with_mqa``) stay, so
        the head's logits shrink by ``scale`` (MindFormers' ``apply_qk_clip_scaling``, Kimi
        K2's MuonClip for MLA). Works on this rank's pieces (rows ``Shard.offset[0]`` on of
        the full weight; FSDP padding untouched). Returns the number of heads clipped."""
        model = self.model
        if model is None or not max_logits:
            return 0
        heads, nope, rope, v = (model.num_attention_heads, model.qk_nope_head_dim, model.qk_rope_head_dim,
                                model.v_head_dim)
        shards = self.layout.shards() if self.layout is not None else None
        clipped = set()
        for i, name in enumerate(self.names):
            hit = _QK_WEIGHT.search(name)
            if hit is None or int(hit.group(1)) not in max_logits:
                continue
            layer = int(hit.group(1))
            top = np.asarray(max_logits[layer], np.float64)
            fire = top >= threshold
            if not fire.any():
                continue
            clipped.update((layer, h) for h in np.flatnonzero(fire))
            scale = np.where(fire, threshold / np.where(fire, top, 1.0), 1.0)
            root = np.sqrt(scale)
            if hit.group(2) == "kv_b_proj":
                rows = np.concatenate([np.repeat(root[:, None], nope, 1), np.ones((heads, v))], 1)
            else:  # q_b_proj / q_proj
                rows = np.concatenate([np.repeat(root[:, None], nope, 1), np.repeat(scale[:, None], rope, 1)], 1)
            rows = rows.reshape(-1)
            p = self.params[i]
            a = p.asnumpy().astype(np.float32).reshape(-1).copy()
            if shards is None:
                box_shape, first = tuple(p.shape), 0
            else:
                box_shape, first = tuple(shards[i].shape), shards[i].offset[0]
            n = int(np.prod(box_shape))
            if n == 0:
                continue
            box = a[:n].reshape(box_shape)
            box *= rows[first:first + box_shape[0]].reshape((-1,) + (1,) * (len(box_shape) - 1)).astype(np.float32)
            value = Tensor(a.reshape(tuple(p.shape))).astype(p.dtype)
            if p.untyped_storage().nbytes() != p.nbytes:  # a piece of AdamW's flat buffer: ops.assign refuses views
                p.set_data(value)  # (AdamW takes it back into its buffer at its next step)
            else:
                ops.assign(p, value)
        return len(clipped)

    # ------------------------------------------------------------------ state
    def moment_sets(self) -> list[tuple[str, list[int], list[Parameter]]]:
        """(checkpoint prefix, parameter indices, state tensors aligned with them): AdamW's
        moments of its parameters, Muon's momentum buffers (MindFormers: ``muon_m.<name>``)."""
        return [("exp_avg", self.adamw_idx, self.adamw.exp_avg), ("exp_avg_sq", self.adamw_idx, self.adamw.exp_avg_sq),
                (MOMENTUM, self.muon_idx, self.muon_m)]

    def state_bytes(self) -> int:
        return self.adamw.state_bytes() + int(sum(t.size * t.itemsize for t in self.muon_m))

    def state_dict(self) -> dict[str, np.ndarray]:
        """``exp_avg.<n>`` / ``exp_avg_sq.<n>`` of the AdamW parameters, ``muon_m.<n>`` of the
        Muon ones, and ``step``."""
        out = self.adamw.state_dict()
        out["step"] = np.array(self.step_count, np.int64)
        for i, m in zip(self.muon_idx, self.muon_m):
            out[f"{MOMENTUM}.{self.names[i]}"] = m.asnumpy().copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        missing = [f"{MOMENTUM}.{self.names[i]}" for i in self.muon_idx if f"{MOMENTUM}.{self.names[i]}" not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {missing[0]} (and {len(missing) - 1} more): not a Muon state")
        self.adamw.load_state_dict(state)
        self.step_count = self.adamw.step_count
        for i, m in zip(self.muon_idx, self.muon_m):
            m.set_data(Tensor(np.ascontiguousarray(state[f"{MOMENTUM}.{self.names[i]}"], np.float32)))


def build_optimizer(named_params: Sequence[tuple[str, Parameter]], cfg: OptimizerConfig, lr: float,
                    layout: Any = None, model: Any = None):
    """The optimizer ``optimizer.type`` names: :class:`AdamW` or :class:`Muon`."""
    if cfg.type == "Muon":
        return Muon.from_config(named_params, cfg, lr, layout=layout, model=model)
    return AdamW.from_config(named_params, cfg, lr)
