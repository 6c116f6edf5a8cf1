"""How the model may be sharded, as plain data (the parallel package applies it).

Weights are HF-shaped ``[out, in]``; routed experts are stacked ``[E, out, in]``.
"""

from __future__ import annotations

import re
from typing import Any

# (suffix pattern, tensor-parallel style, split dim); first match wins
_TP_RULES: list[tuple[str, str, int | None]] = [
    (r"^model\.embed_tokens\.weight$", "vocab", 0),
    (r"^lm_head\.weight$", "column", 0),
    (r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$", "column", 0),
    (r"\.self_attn\.o_proj\.weight$", "row", 1),
    (r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", "column", 0),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", "row", 1),
    (r"\.mlp\.experts\.(gate_proj|up_proj)$", "column", 1),
    (r"\.mlp\.experts\.down_proj$", "row", 2),
]


def _tp(name: str) -> tuple[str, int | None]:
    for pattern, style, dim in _TP_RULES:
        if re.search(pattern, name):
            return style, dim
    # low-rank down projections, norms, router, eh_proj and biases stay whole on every rank
    return "replicated", None


def parallel_plan(model) -> dict[str, Any]:
    """``{"params": {name: {...}}, "units": [...], ...}`` for every parameter of ``model``.

    Per parameter: ``shape``; ``tp`` ("column": split the output dim, "row": split the input
    dim, "vocab": split the vocabulary rows, "replicated") and ``tp_dim``; ``expert`` (True
    for routed-expert weights), ``expert_dim`` (0) and ``num_experts``; ``trainable``; ``unit``.
    ``units`` is the ordered list of modules FSDP wraps and pipeline stages hold: the
    embedding, each decoder layer, the final norm + lm_head, each MTP module; each with
    ``name``, ``kind`` ("embedding", "decoder", "head", "mtp"), ``layer`` index or None and
    its ``params``. ``shared`` lists weights used by more than one unit (the MTP modules use
    the embedding and the head).
    """
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    units: list[dict[str, Any]] = [{"name": "embedding", "kind": "embedding", "layer": None, "params": []}]
    units += [{"name": f"layers.{i}", "kind": "decoder", "layer": i, "params": []} for i in range(n_layers)]
    units.append({"name": "head", "kind": "head", "layer": None, "params": []})
    units += [{"name": f"mtp.{k}", "kind": "mtp", "layer": n_layers + k, "params": []}
              for k in range(cfg.num_nextn_predict_layers)]
    by_name = {u["name"]: u for u in units}

    params: dict[str, dict[str, Any]] = {}
    for p in model.get_parameters():
        name = p.name
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m:
            idx = int(m.group(1))
            unit = f"layers.{idx}" if idx < n_layers else f"mtp.{idx - n_layers}"
        elif name.startswith("model.embed_tokens."):
            unit = "embedding"
        else:
            unit = "head"  # model.norm.weight, lm_head.weight
        style, dim = _tp(name)
        expert = bool(re.search(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$", name))
        params[name] = {
            "shape": tuple(p.shape),
            "tp": style,
            "tp_dim": dim,
            "expert": expert,
            "expert_dim": 0 if expert else None,
            "num_experts": cfg.n_routed_experts if expert else None,
            "trainable": bool(p.requires_grad),
            "unit": unit,
        }
        by_name[unit]["params"].append(name)
    shared = {}
    if cfg.num_nextn_predict_layers:
        shared = {"model.embed_tokens.weight": ["embedding"] + [f"mtp.{k}" for k in range(cfg.num_nextn_predict_layers)],
                  "lm_head.weight": ["head"] + [f"mtp.{k}" for k in range(cfg.num_nextn_predict_layers)]}
    return {
        "params": params,
        "units": units,
        "shared": shared,
        "num_attention_heads": cfg.num_attention_heads,
        "num_experts": cfg.n_routed_experts,
    }
