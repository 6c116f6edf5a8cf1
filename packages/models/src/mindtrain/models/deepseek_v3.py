"""DeepSeek-V3 for causal LM training: HF DeepseekV3ForCausalLM's math and parameter names,
plus the sequence-wise balance loss, aux-loss-free bias update and multi-token prediction."""

from __future__ import annotations

import re
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindtrain.config import ConfigError, ModelConfig, RecomputePlan, module_matches, recompute_plan
from mindtrain.config.schema import RecomputeConfig
from mindtrain.models import kernels
from mindtrain.models.attention_mask import additive_mask
from mindtrain.models.decoder import DecoderLayer
from mindtrain.models.inputs import shift_left, whole_sequence_inputs
from mindtrain.models.linear import Linear
from mindtrain.models.loss import MaskedCrossEntropy, TokenCrossEntropy
from mindtrain.models.mtp import MTPLayer
from mindtrain.models.norm import RMSNorm
from mindtrain.models.recompute import (Recompute, SharedGraphRecompute, TwinBinding, cell_kind, compiled_copy,
                                        compiled_method, install_jit, recompute_submodule)
from mindtrain.models.precision import (DTYPES, check_param_dtype, current_device, resolve_compute_dtype,
                                        to_compute)
from mindtrain.models.rope import RotaryEmbedding
from mindtrain.models.weights import Init, new_weight


def _ranges(ids) -> str:
    ids = sorted(ids)
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


class Embedding(nn.Cell):
    """``weight [V, H]`` looked up with ops.gather (F.embedding has no CPU kernel)."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float):
        super().__init__()
        self.weight = new_weight((vocab_size, hidden_size), Init("normal", init_std), "weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class DeepseekV3Model(nn.Cell):
    """``embed_tokens``, ``layers`` (decoder layers, then the MTP modules), ``norm``."""

    def __init__(self, cfg: ModelConfig, moe_block: int = 32):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        layers = [DecoderLayer(cfg, i, moe_block) for i in range(cfg.num_hidden_layers)]
        layers += [MTPLayer(cfg, cfg.num_hidden_layers + k, moe_block) for k in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.CellList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings)


class _HeadLoss(nn.Cell):
    """Final norm + lm_head + masked cross-entropy as one cell so it can be one jit graph.
    Holds no parameters of its own (norm and head are passed in). The head matmul runs in
    ``matmul_dtype``; norm and cross-entropy in float32.

    Two hooks let a layout change how it runs without re-implementing it (both eager-only):
    ``sequence_gather`` (None by default) maps the normed hidden states [B, S_local, H] of a
    sequence-parallel rank to [B, S, H] before the head; ``ce.token_loss`` is the per-token
    cross-entropy (see :class:`~mindtrain.models.loss.MaskedCrossEntropy`).
    """

    matmul_dtype = None
    fast_kernels = False

    def __init__(self):
        super().__init__()
        self.ce = MaskedCrossEntropy()
        self.matmul = ops.MatMul(transpose_b=True)
        self.sequence_gather = None

    def hooks_unset(self) -> bool:
        """True while no layout has set a hook (then the cell can be one graph)."""
        return self.sequence_gather is None and isinstance(self.ce.token_loss, TokenCrossEntropy)

    def construct(self, h, norm_weight, eps, head_weight, labels, loss_mask):
        x = h.reshape(-1, h.shape[-1])
        if self.fast_kernels:
            x = kernels.fast_rms_norm(x, norm_weight, eps)
        else:
            x = norm_weight * (x * ops.rsqrt(ops.mean(ops.square(x), -1, keep_dims=True) + eps))
        if self.sequence_gather is not None:
            x = self.sequence_gather(x.reshape(h.shape)).reshape(-1, h.shape[-1])
        cd = self.matmul_dtype
        logits = self.matmul(to_compute(x, cd), to_compute(head_weight, cd))
        if cd is not None:
            logits = ops.cast(logits, ms.float32)
        return self.ce(logits, labels, loss_mask)


class DeepseekV3ForCausalLM(nn.Cell):
    """DeepSeek-V3 causal LM. See the package README for the call conventions.

    ``compute_dtype`` None takes ``cfg.compute_dtype`` with the device's fallback
    (:func:`mindtrain.models.effective_compute_dtype`); a given dtype the device cannot run
    is a ConfigError. Parameters are float32 (``cfg.param_init_dtype``). The fast-kernel
    switch (:mod:`mindtrain.models.kernels`) is read here, once.
    """

    def __init__(self, cfg: ModelConfig, moe_block: int = 32, jit: bool = False,
                 compute_dtype: Optional[str] = None, recompute: Optional[RecomputeConfig] = None):
        super().__init__()
        check_param_dtype(cfg.param_init_dtype)
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
        self._jit = False
        self._jit_granularity: Optional[str] = None
        self._twins = False
        self._head_graph = None
        self._rope_mask_cache: dict = {}
        self._configure_cells()
        self._recompute_layers: dict[int, Recompute] = {}
        self._kind_twins: dict = {}  # cell_kind -> its compiled twin (compiled_twin)
        self.twin_runners: dict[int, SharedGraphRecompute] = {}
        """Layer index -> the runner that runs it in its kind's twin (compiled full recompute,
        ``set_jit(..., twins=True)``); made at the layer's first run."""
        self.recompute_plan = RecomputePlan()
        self.recompute_wrappers: dict[str, Recompute] = {}
        """Every recompute wrapper by what it recomputes ("model.layers.3",
        "model.layers.3.self_attn.core_attention"); their ``forward_calls`` count runs."""
        if jit:
            self.set_jit(True)
        if recompute is not None:
            self.set_recompute(recompute)

    def _configure_cells(self) -> None:
        """Give every layer that has the attributes the matmul dtype and the kernel choice;
        they must be fixed before a layer's first (possibly compiled) call."""
        matmul_dtype = None if self.compute_dtype == "float32" else DTYPES[self.compute_dtype]
        for _, cell in self.cells_and_names():
            if hasattr(type(cell), "matmul_dtype"):
                cell.matmul_dtype = matmul_dtype
            if hasattr(type(cell), "fast_kernels"):
                cell.fast_kernels = self.fast_kernels

    # ------------------------------------------------------------------ jit
    def set_jit(self, enabled: bool = True, granularity: str = "layer",
                twins: bool = False) -> "DeepseekV3ForCausalLM":
        """Compile the model with ms.jit (True), or run it eagerly (False).

        ``granularity="layer"``: each decoder layer and the head + loss is one graph.
        ``granularity="region"``: the pieces between a layout's collectives are graphs —
        per layer the norms, the attention's ``project`` and ``attend`` (around the
        context-parallel exchange), the dense MLP or the MoE's router, routed experts and
        shared experts — while the layer, attention and MoE forwards that stitch them stay
        eager, so tensor/expert/context parallelism can wrap them or set their hooks; the
        head + loss is one graph while no layout has set its hooks. Call it before a layout
        wraps cells (a wrapper calls the cell's forward as it finds it).

        A graph reads the parameter storage it was compiled with: in-place updates
        (``ops.assign``, the AdamW kernel) reach it, a parameter swapped by ``set_data`` does
        not. Only forwards this method installed are removed again, so forward overrides
        that other code put on these cells survive.

        ``twins=True``: every decoder layer and MTP module runs in the compiled copy of its
        kind (:meth:`compiled_twin`), its weights written in before each run
        (:class:`~mindtrain.models.recompute.SharedGraphRecompute`: the layer keeps no
        activations and runs its forward again in backward). For a layout that swaps the
        weights' storage between steps (a pipeline stage under ZeRO-3 gathers its weights
        for each step by ``set_data``), which a graph of the layer's own would never see.
        """
        if granularity not in ("layer", "region"):
            raise ValueError(f"set_jit: granularity must be 'layer' or 'region', not {granularity!r}")
        for _, cell in self.cells_and_names():
            mine = cell.__dict__.get("_mindtrain_jit")
            if not mine:
                continue
            for attr, fn in mine.items():
                if cell.__dict__.get(attr) is fn:
                    object.__delattr__(cell, attr)
            object.__delattr__(cell, "_mindtrain_jit")
        self._jit = bool(enabled)
        self._jit_granularity = granularity if enabled else None
        self._twins = bool(enabled and twins)
        self._head_graph = None
        self._drop_twins()
        blocked = self._configure_row_blocks()
        if not enabled:
            return self
        for i, layer in enumerate(self.model.layers):
            if granularity == "layer" and i not in blocked:
                install_jit(layer, "construct")
                continue
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                install_jit(norm, "construct")
            install_jit(layer.self_attn, "project")
            if i in blocked:  # the core between two graphs, eager in blocks
                install_jit(layer.self_attn, "keys_values")
                install_jit(layer.self_attn, "output")
            else:
                install_jit(layer.self_attn, "attend")
            if layer.is_moe:
                install_jit(layer.mlp.gate, "construct")
                install_jit(layer.mlp.experts, "construct")
                if layer.mlp.n_shared:
                    install_jit(layer.mlp.shared_experts, "forward")
            else:
                install_jit(layer.mlp, "forward")
        if granularity == "layer":
            install_jit(self.head_loss, "construct")
        else:  # not installed as its construct: a layout may set its hooks after this call
            self._head_graph = compiled_method(self.head_loss, "construct")
        return self

    @property
    def jit_enabled(self) -> bool:
        return self._jit

    @property
    def jit_granularity(self) -> Optional[str]:
        """``"layer"`` or ``"region"`` when compiled (see :meth:`set_jit`), else None."""
        return self._jit_granularity

    @property
    def jit_twins(self) -> bool:
        """Every layer runs in its kind's compiled twin (``set_jit(..., twins=True)``)."""
        return self._twins

    # ------------------------------------------------------------------ recompute
    def set_recompute(self, recompute) -> "DeepseekV3ForCausalLM":
        """Recompute activations as ``recompute`` (a ``RecomputeConfig`` or a resolved
        :class:`mindtrain.config.RecomputePlan`) says; call once, before the first step.

        Whole layers (``full``): the layer runs through :class:`~mindtrain.models.recompute.Recompute`
        (no activations kept, forward run again in backward; a compiled layer stays compiled).
        Modules (``select``): each pattern is a regular expression matched in full against
        the dotted sub-cell paths of a layer (``self_attn``, ``self_attn.core_attention``,
        ``mlp``, ``mlp.experts``, ``mlp.shared_experts``, ...; MindFormers' names
        ``self_attention``, ``pre_mlp_layernorm`` and ``mlp.router`` match too); a match
        inside another match is covered by it. A pattern matching nothing is a ConfigError.
        """
        plan = recompute if isinstance(recompute, RecomputePlan) else \
            recompute_plan(recompute, len(self.model.layers))
        if self._recompute_layers or self.recompute_wrappers:
            raise RuntimeError("set_recompute: recompute is already set on this model")
        for i in plan.full:
            self._recompute_layers[i] = Recompute(self.model.layers[i])
            self.recompute_wrappers[f"model.layers.{i}"] = self._recompute_layers[i]
        for pattern, ids in plan.select.items():
            try:
                rx = re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"recompute.select_module.{pattern}", f"is not a regular expression ({e})") from None
            matched = False
            for i in ids:
                layer = self.model.layers[i]
                paths = [name for name, _ in layer.cells_and_names() if name]
                hits = [p for p in paths if module_matches(rx, p)]
                hits = [p for p in hits if not any(p.startswith(q + ".") for q in hits)]
                for path in hits:
                    key = f"model.layers.{i}.{path}"
                    if key in self.recompute_wrappers or any(key.startswith(k + ".") for k in self.recompute_wrappers):
                        continue
                    cell = dict(layer.cells_and_names())[path]
                    self.recompute_wrappers[key] = recompute_submodule(cell)
                    matched = True
            if not matched:
                names = sorted(p for p, _ in self.model.layers[ids[0]].cells_and_names() if p)
                raise ConfigError(f"recompute.select_module.{pattern}",
                                  f"matches no module of layer(s) {_ranges(ids)}; modules are e.g. "
                                  f"{', '.join(n for n in names if n.count('.') < 2)}")
        self.recompute_plan = plan
        if self._jit:  # layers whose recomputed core runs in blocks compile around it
            self.set_jit(True, self._jit_granularity, twins=self._twins)
        else:
            self._configure_row_blocks()
        return self

    def _core_recomputed(self, i: int) -> bool:
        """Layer ``i``'s attention core is recomputed: the whole layer, or a selected module
        that is the core or holds it."""
        path = f"model.layers.{i}.self_attn.core_attention"
        return any(path == k or path.startswith(k + ".") for k in getattr(self, "recompute_wrappers", {}))

    def _blocked_cores(self) -> set:
        """Layers whose attention core is recomputed and whose scores at the configured
        sequence length (batch 1) exceed one block (``CoreAttention.row_block_elements``):
        their core runs eager in blocks of rows, compiled or not."""
        cfg = self.config
        out = set()
        for i, layer in enumerate(self.model.layers):
            core = layer.self_attn.core_attention
            scores = layer.self_attn.num_heads * cfg.seq_length * cfg.seq_length
            if self._core_recomputed(i) and scores > core.row_block_elements:
                out.add(i)
        return out

    def _configure_row_blocks(self) -> set:
        """Layers whose attention core is recomputed run it in blocks of query rows
        (:meth:`CoreAttention.recompute_in_row_blocks`) when the layer is eager or the scores
        exceed a block (a compiled model then compiles the layer around its core, see
        :meth:`set_jit`): no pass holds more than one block's scores. Returns the layers
        whose core is in blocks at any jit setting (:meth:`_blocked_cores`)."""
        blocked = self._blocked_cores()
        for i, layer in enumerate(self.model.layers):
            covered = self._core_recomputed(i)
            layer.self_attn.core_attention.recompute_in_row_blocks(covered and (not self._jit or i in blocked))
        return blocked

    def _layer_call(self, i: int):
        """Layer ``i`` as the forward calls it: its recompute wrapper, unless the layer
        (e.g. a ZeRO-3 unit, which already frees and replays its forward) has a custom
        backward of its own or layouts replaced the layer object. A layer compiled whole
        runs in the compiled copy of its kind (:class:`SharedGraphRecompute`), and so does
        every layer with ``set_jit(..., twins=True)``."""
        layer = self.model.layers[i]
        rc = self._recompute_layers.get(i)
        if layer.has_bprop:
            return layer
        if self._twins:
            return self._shared_graph(i, layer, recomputed=rc is not None)
        if rc is None:
            return layer
        if self._jit_granularity == "layer" and "construct" in (layer.__dict__.get("_mindtrain_jit") or {}):
            return self._shared_graph(i, layer)
        if rc.target is not layer:  # a layout swapped the layer object
            rc = self._recompute_layers[i] = Recompute(layer)
        self.recompute_wrappers[f"model.layers.{i}"] = rc
        return rc

    def _shared_graph(self, i: int, layer: nn.Cell, recomputed: bool = True) -> SharedGraphRecompute:
        runner = self.twin_runners.get(i)
        if runner is None or runner.target is not layer:
            runner = SharedGraphRecompute(layer, self.compiled_twin(layer), 2 if isinstance(layer, MTPLayer) else 1)
            self.twin_runners[i] = runner
        if recomputed:
            self.recompute_wrappers[f"model.layers.{i}"] = runner
        return runner

    def _drop_twins(self) -> None:
        self._kind_twins = {}
        self.twin_runners = {}
        for i, rc in self._recompute_layers.items():
            self.recompute_wrappers[f"model.layers.{i}"] = rc

    def compiled_twin(self, cell: nn.Cell) -> nn.Cell:
        """The compiled copy that every cell of ``cell``'s kind (:func:`~mindtrain.models.recompute.cell_kind`)
        runs in: its own parameters, its compiled methods compiled again for it
        (:func:`~mindtrain.models.recompute.compiled_copy`); made at the first call for a
        kind, dropped by :meth:`set_jit`. Compiled full recompute runs the layers in these,
        and so does mindtrain-parallel's ZeRO-3 for its compiled units. A caller writes a
        cell's weights into its twin's before each run (a graph reads the storage it was
        compiled with)."""
        kind = cell_kind(cell)
        twin = self._kind_twins.get(kind)
        if twin is None:
            twin = self._kind_twins[kind] = compiled_copy(cell)
        return twin

    def twin_bytes(self) -> int:
        """Bytes of the trained weights that the compiled twins made so far hold."""
        return sum(int(p.size) * p.itemsize for twin in self._kind_twins.values()
                   for p in twin.get_parameters() if p.requires_grad)

    def twin_binding(self, twin: nn.Cell, cell: nn.Cell) -> TwinBinding:
        """What ``twin`` (:meth:`compiled_twin` of ``cell``) takes from ``cell`` before each
        run besides its trained weights (:class:`~mindtrain.models.recompute.TwinBinding`:
        its untrained parameters, and a layout's per-cell state such as expert
        parallelism's local experts)."""
        return TwinBinding(twin, cell)

    # ------------------------------------------------------------------ forward
    def construct(self, input_ids, labels=None, loss_mask=None, position_ids=None, attention_mask=None):
        b, s = input_ids.shape
        cos, sin, mask_add = self._rope_and_mask(b, s, position_ids, attention_mask)
        if labels is not None:
            if loss_mask is None:
                loss_mask = ops.ones(labels.shape, ms.float32)
            depths = self.mtp_inputs(input_ids, labels, loss_mask)

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

    # The pieces ``construct`` is made of. Layouts (pipeline stages, tensor and context
    # parallelism) call these, or swap a hook of the cells they run, instead of repeating them.
    def embed(self, input_ids):
        """Token embeddings [B, S, H] of ``input_ids`` [B, S]."""
        return self.model.embed_tokens(input_ids)

    def rope(self, position_ids):
        """cos, sin [B, 1, S, qk_rope_head_dim] for ``position_ids`` [B, S]."""
        cos, sin = self.model.rotary_emb(position_ids)
        return ops.expand_dims(cos, 1), ops.expand_dims(sin, 1)

    def run_layers(self, h, layer_ids, cos, sin, mask_add):
        """The decoder layers ``layer_ids`` in order -> ``(h, counts, balances)``: the tokens
        per expert and sequence balance loss of each MoE layer among them."""
        counts, balances = [], []
        for i in layer_ids:
            layer = self.model.layers[i]
            h, c, bal = self._layer_call(i)(h, cos, sin, mask_add)
            if layer.is_moe:
                counts.append(c)
                balances.append(bal)
        return h, counts, balances

    def logits(self, h):
        """Final norm and lm_head: float32 logits [B, S, V]."""
        logits = self.lm_head(self.model.norm(h))
        return logits if logits.dtype == ms.float32 else ops.cast(logits, ms.float32)

    def lm_loss(self, h, labels, loss_mask):
        """Final norm, lm_head and the masked mean cross-entropy (one cell, ``head_loss``)."""
        norm = self.model.norm
        return self._head_loss(h, norm.weight, norm.eps, self.lm_head.weight, labels, loss_mask)

    def _head_loss(self, *args):
        """``head_loss`` as compiled by regions while no layout has set its hooks."""
        if self._head_graph is not None and self.head_loss.hooks_unset():
            return self._head_graph(*args)
        return self.head_loss(*args)

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
        :meth:`mtp_inputs`). Returns ``(losses per depth, counts, balances)``."""
        losses, counts, balances = [], [], []
        for k, (ids_k, labels_k, mask_k) in enumerate(depths, 1):
            layer = self.model.layers[self.num_layers + k - 1]
            h, c, bal = self._layer_call(self.num_layers + k - 1)(h, self.embed(ids_k), cos, sin, mask_add)
            if layer.is_moe:
                counts.append(c)
                balances.append(bal)
            norm = layer.shared_head.norm
            losses.append(self._head_loss(h, norm.weight, norm.eps, self.lm_head.weight, labels_k, mask_k))
        return losses, counts, balances

    def combine_losses(self, lm_loss, mtp_losses, balances):
        """The training loss from its parts: ``lm_loss + mtp_loss_scaling_factor *
        mean(mtp_losses) + aux_loss_alpha * sum(balances)``. Any part may be absent (None /
        empty): a pipeline stage without the head passes only its layers' balances, and the
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
            balance = sum(balances[1:], balances[0])
            metrics["load_balancing_loss"] = balance
            if cfg.aux_loss_alpha:
                term = cfg.aux_loss_alpha * balance
                loss = term if loss is None else loss + term
        if loss is None:
            loss = ops.zeros((), ms.float32)
        return loss, metrics

    def whole_sequence_inputs(self, batch, mtp_depths: Optional[int] = None) -> dict:
        """Numpy inputs of whole sequences (see :func:`mindtrain.models.inputs.whole_sequence_inputs`);
        ``mtp_depths`` defaults to the model's. Context parallelism chunks these."""
        return whole_sequence_inputs(batch, self.num_mtp if mtp_depths is None else mtp_depths)

    def _rope_and_mask(self, b: int, s: int, position_ids, attention_mask):
        """cos/sin [B, 1, S, rope] and the additive mask. The default-position tables and the
        causal-only mask are the same every step, so they are cached per (B, S)."""
        cache = self._rope_mask_cache
        if position_ids is None:
            if ("rope", b, s) not in cache:
                pos = Tensor(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy())
                cos, sin = self.model.rotary_emb(pos)
                cache[("rope", b, s)] = (ops.expand_dims(cos, 1), ops.expand_dims(sin, 1))
            cos, sin = cache[("rope", b, s)]
        else:
            cos, sin = self.rope(position_ids)
        if attention_mask is None:
            if ("mask", b, s) not in cache:
                cache[("mask", b, s)] = additive_mask(None, b, s, self.config.num_attention_heads)
            mask_add = cache[("mask", b, s)]
        else:
            mask_add = additive_mask(attention_mask, b, s, self.config.num_attention_heads)
        if len(cache) > 8:  # many shapes (e.g. evaluation): keep memory bounded
            self._rope_mask_cache = {}
        return cos, sin, mask_add

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
            # ops.assign writes the existing buffer, which compiled (jit) layers read;
            # set_data would swap in a new tensor that they never see.
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
        if enabled and self._jit:
            raise RuntimeError("record_routing needs set_jit(False): a compiled layer cannot record")
        for router in self.moe_routers():
            router.recorded = [] if enabled else None

