"""How the model may be sharded, as a typed plan (:mod:`mindtrain.config.plan`; the parallel
package applies it).

Weights are HF-shaped ``[out, in]``; routed experts are stacked ``[E, out, in]``.
"""

from __future__ import annotations

import re

from mindtrain.config.families import residual_streams
from mindtrain.config.model_plan import is_expert, param_specs, tp_split, unit_of, units as plan_units
from mindtrain.config.plan import ParallelPlan, ParamPlan, Region, UnitPlan
from mindtrain.models.lora import base_weight, is_adapter


def _split_field(name: str, style: str, dim: int | None, expert: bool) -> str | None:
    """The config field a TP split of ``name`` must divide (named when it does not)."""
    if style == "replicated":
        return None
    if style == "vocab" or name == "lm_head.weight":
        return "model.vocab_size"
    if expert:
        return "model.moe_intermediate_size"
    if ".mlp.shared_experts." in name:
        return "model.moe_intermediate_size x n_shared_experts"
    if ".mlp." in name:
        return "model.intermediate_size"
    if re.search(r"\.self_attn\.(k_proj|v_proj)\.", name):
        return "model.num_key_value_heads"
    if re.search(r"\.self_attn\.(o_a_proj|o_b_proj)\.", name):  # DeepSeek-V4's grouped output projection
        return "model.o_groups"
    if ".self_attn." in name:
        return "model.num_attention_heads"
    return f"model ({name} dim {dim})"


def _adapter_split(name: str, style: str, dim: int | None) -> tuple[str, int | None]:
    """A LoRA adapter's TP split, from its weight's [out, in] split: a column (or vocabulary)
    split of ``out`` splits ``lora_b`` [out, r] on dim 0, a row split of ``in`` splits
    ``lora_a`` [r, in] on dim 1; the other factor is whole on every TP rank (its gradient
    summed over TP as any replicated weight's), as MindFormers lays them out."""
    if style in ("column", "vocab") and dim == 0 and name.endswith(".lora_b"):
        return "column", 0
    if style == "row" and dim == 1 and name.endswith(".lora_a"):
        return "row", 1
    return "replicated", None


def _regions(model) -> list[Region]:
    """The cells the layouts treat as a whole, by role: the embedding, every attention
    block, every dense MLP outside a MoE block, every MoE block, the head projection."""
    regions: list[Region] = [Region("model.embed_tokens", "embedding")]
    moe_paths: list[str] = []
    for path, cell in model.cells_and_names():
        if not path or any(path.startswith(m + ".") for m in moe_paths):
            continue  # a MoE block's shared experts run inside its own forward
        region = Region.declared_by(cell)  # each family's cells declare it
        if region is None:
            continue
        if region.role == "moe":
            moe_paths.append(path)
        if region.role in ("attention", "moe", "mlp"):
            regions.append(region.at(path))
    if getattr(model, "lm_head", None) is not None:  # a tied head (Qwen3) multiplies by the embedding
        regions.append(Region("lm_head", "head"))
    return regions


def _role(name: str, regions: list[Region]) -> str | None:
    if name in ("lm_head.weight", "model.norm.weight"):
        return "head"
    for r in regions:
        if name.startswith(r.path + "."):
            return r.role
    return None


def parallel_plan(model) -> ParallelPlan:
    """The :class:`mindtrain.config.plan.ParallelPlan` of ``model``: every parameter, the
    units, the shared weights and the regions.

    Per parameter: ``shape``; ``tp`` ("column": split the output dim, "row": split the input
    dim, "vocab": split the vocabulary rows, "replicated") and ``tp_dim``; ``split_field``
    (the config field the split must divide); ``expert`` (True for routed-expert weights),
    ``expert_dim`` (0) and ``num_experts``; ``trainable``; ``unit``; ``role`` (embedding,
    attention, mlp, moe, head, or None for layer norms and MTP projections);
    ``applied_outside`` (an MTP module's shared-head norm, which the head applies).
    ``units`` is the ordered list of modules FSDP wraps and pipeline stages hold: the
    embedding, each decoder layer, the final norm + lm_head, each MTP module; each with
    ``name``, ``kind`` ("embedding", "decoder", "head", "mtp"), ``layer`` index or None, its
    ``params`` and its cell ``path``. ``shared`` lists weights used by more than one unit (the
    MTP modules use the embedding and the head); ``regions`` the cells by role.
    """
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    n_mtp = cfg.num_nextn_predict_layers
    # the units the config's parameter plan names (mindtrain.config.model_plan), with the
    # model's own parameters (buffers included)
    units = [UnitPlan(u.name, u.kind, u.layer, [], u.path) for u in plan_units(cfg)]
    by_name = {u.name: u for u in units}
    regions = _regions(model)

    # the config's parameter plan gives each trainable parameter its split (a family may keep
    # parts whole: DeepSeek-V4's attention); buffers follow the name rules
    splits = {s.name: (s.tp, s.tp_dim) for s in param_specs(cfg)}
    params: dict[str, ParamPlan] = {}
    for p in model.get_parameters():
        name = p.name
        unit = unit_of(name, n_layers)
        style, dim = splits.get(name) or tp_split(name)
        if is_adapter(name):  # a LoRA adapter splits with its weight's split dim, else stays whole
            style, dim = _adapter_split(name, *(splits.get(base_weight(name)) or tp_split(base_weight(name))))
        expert = is_expert(name)
        params[name] = ParamPlan(
            shape=tuple(p.shape),
            tp=style,
            tp_dim=dim,
            expert=expert,
            expert_dim=0 if expert else None,
            num_experts=cfg.n_routed_experts if expert else None,
            trainable=bool(p.requires_grad),
            unit=unit,
            role=_role(name, regions),
            split_field=_split_field(name, style, dim, expert),
            # an MTP module's shared-head norm is applied by the head, outside the module
            applied_outside=".shared_head." in name,
        )
        by_name[unit].params.append(name)
    shared = {}
    if getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in params:  # Qwen3's tied head
        shared["model.embed_tokens.weight"] = ["embedding", "head"]
    if n_mtp:
        shared = {"model.embed_tokens.weight": ["embedding"] + [f"mtp.{k}" for k in range(n_mtp)],
                  "lm_head.weight": ["head"] + [f"mtp.{k}" for k in range(n_mtp)]}
    # the hidden states between units: DeepSeek-V4's residual is hc_mult streams [B, S, N, H]
    streams = residual_streams(cfg)
    activation = (streams, cfg.hidden_size) if streams > 1 else (cfg.hidden_size,)
    return ParallelPlan(params=params, units=units, shared=shared, regions=regions,
                        num_attention_heads=cfg.num_attention_heads, num_experts=cfg.n_routed_experts,
                        activation=activation)
