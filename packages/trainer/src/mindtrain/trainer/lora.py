"""LoRA fine-tuning (``lora_config``) with MindFormers' PyNative semantics.

Which layers: MindFormers' ``build_lora_model`` walks its model's cells and gives an adapter to
every ``Linear`` whose dotted cell path matches ``target_modules`` (``re.search``), skipping any
cell (and all below it) whose path matches ``exclude_layers``. Its paths are those of
``PyNative*ForCausalLM``: ``model.`` + the parameter's prefix, e.g.
``model.decoder.layers.0.self_attention.linear_qkv``, ``model.decoder.layers.1.mlp.linear_fc2``,
``model.output_layer``, ``model.mtp.layers.0.eh_proj``. Each of mindtrain's Linear layers is
matched by the path of the MindFormers layer holding its weight (the checkpoint name table,
:mod:`mindtrain.trainer.mindformers_name_table`). MindFormers' fused layers are several layers
here (``linear_qkv``: ``q_a_proj`` (or ``q_proj``) + ``kv_a_proj_with_mqa`` of MLA, or Qwen3's
``q_proj`` / ``k_proj`` / ``v_proj``; ``linear_fc1``: ``gate_proj`` + ``up_proj``), and MindFormers
gives the fused layer ONE adapter: ``lora_a`` [r, in] shared by the parts, ``lora_b`` [sum(out), r].
So here, in both layouts, the parts share one ``lora_a`` (held by the first part, q / gate; the
others hold only their rows of ``lora_b``, :func:`mindtrain.models.lora.add_adapter`): the same
function, gradients and initial values as MindFormers' (PEFT, which gives each HF module its own
``lora_A``, is the reference with the parts' ``lora_A`` tied: tools/make_lora_fixtures.py).
Routed experts, the router and the embedding are not Linear layers and get none. DeepSeek-V4:
the paths of MindFormers' V4 (``...self_attention.linear_q_down_proj``, ``...core_attention.
compressor.linear_wkv``, ``...core_attention.indexer.linear_wq_b``, ...); its grouped output
projection is a bare parameter there (``linear_o_group_proj``) and gets none, as in MindFormers;
its hyper-connection mappings are Linear layers there but bare parameters here (and in HF):
selecting one is a ConfigError.

Training: the adapters (``<layer>.lora_a`` [r, in], ``.lora_b`` [out, r]) are parameters of the
layout like any other (FSDP shards, TP splits, see :func:`mindtrain.models.parallel_plan`); the
optimizer holds only them (:class:`AdapterOptimizer`), so the base weights never change and
have no optimizer state; the gradient norm (and clipping) is the adapters'. Each save also
writes the adapters alone (:func:`save_adapters`): with ``checkpoint.layout: mindtrain``
PEFT-style (PEFT's names on the HF modules, a fused layer's ``lora_a`` written for each of its
parts), with ``checkpoint.layout: mindformers`` under MindFormers' names and shapes
(``decoder.layers.0.self_attention.linear_qkv.lora_a`` [r, H], ``.lora_b`` [q + kv, r], rows as
the fused weight's), as the adapters sit in the checkpoint. :func:`load_adapters` reads both
(``mindtrain-export-hf --lora`` merges either).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional, Sequence

import numpy as np

from mindtrain.config import ConfigError, MindTrainConfig, UserError
from mindtrain.trainer.lora_rules import excluded, mindformers_path, select_layers
from mindtrain.trainer.mindformers_name_table import fused_first, locate

ADAPTER_DIR = "lora"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


# MindFormers' Linear layers that are bare parameters here (and in HF): DeepSeek-V4's
# hyper-connection mappings (``attn_hc`` / ``ffn_hc``: ``mapping_proj``) and stream heads
# (``hc_head.hc_fn``), multiplied inside the hyper-connection math
_NOT_LINEAR_HERE = re.compile(r"\.(mapping_proj|hc_fn)$")


def _refuse_unbuilt(param_names: Sequence[str], cfg: MindTrainConfig) -> None:
    """A ConfigError (one line) when ``target_modules`` selects a MindFormers Linear layer that
    has no adapter here."""
    lc = cfg.lora_config
    target = re.compile(lc.target_modules)
    exclude = re.compile(lc.exclude_layers) if lc.exclude_layers else None
    for name in param_names:
        try:
            theirs, _ = locate(name, cfg.model)
        except UserError:  # not in the name table: not a MindFormers Linear either
            continue
        path = "model." + theirs[:-len(".weight")]
        if theirs.endswith(".weight") and _NOT_LINEAR_HERE.search(path) and target.search(path) \
                and not excluded(path, exclude):
            raise ConfigError("lora_config.target_modules", f"{lc.target_modules!r} selects {path} (a DeepSeek-V4 "
                              "hyper-connection mapping), which has no LoRA adapter here (HF has no Linear there "
                              "either); narrow the pattern or add it to lora_config.exclude_layers")


def apply_lora(model, cfg: MindTrainConfig, empty: bool) -> list[str]:
    """Give the layers ``lora_config`` selects their adapters (before the layout); returns
    the adapted weights' names. None selected is a ConfigError."""
    from mindtrain.models.lora import add_adapter, linear_layers

    lc = cfg.lora_config
    layers = dict(linear_layers(model))
    _refuse_unbuilt([p.name for p in model.get_parameters()], cfg)
    chosen = select_layers(list(layers), cfg)
    if not chosen:
        example = mindformers_path(next(iter(layers)), cfg.model) if layers else "model.decoder.layers.0..."
        raise ConfigError("lora_config.target_modules", f"{lc.target_modules!r} matches no Linear layer; it is "
                          f"searched in MindFormers' module paths, e.g. {example}")
    firsts = {}  # MindFormers' fused weight -> its first part's layer (the holder of its lora_a)
    for name in sorted(chosen, key=lambda n: not fused_first(locate(n, cfg.model)[1])):
        theirs, how = locate(name, cfg.model)
        share = None if fused_first(how) else firsts[theirs]
        add_adapter(layers[name], lc.lora_rank, lc.lora_alpha, lc.lora_a_std, lc.lora_b_std, empty, share_a=share)
        firsts.setdefault(theirs, layers[name])
    if lc.lora_dropout > 0:
        from mindtrain.models.dropout import attach_lora_dropout

        attach_lora_dropout(model, lc.lora_dropout)
    return chosen


def peft_name(name: str) -> str:
    """PEFT's name of adapter ``name``: ``model.layers.0.self_attn.q_a_proj.lora_a`` ->
    ``base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight``."""
    layer, kind = name.rsplit(".", 1)
    return f"base_model.model.{layer}.lora_{kind[-1].upper()}.weight"


def from_peft_name(name: str) -> str:
    """The inverse of :func:`peft_name`."""
    m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", name)
    if m is None:
        raise ValueError(f"{name}: not a PEFT LoRA tensor name")
    return f"{m.group(1)}.lora_{m.group(2).lower()}"


class AdapterOptimizer:
    """The optimizer of the adapters only, with the interface of the optimizer it wraps, on
    the layout's full parameter list: :meth:`step` takes every parameter's gradient and
    uses the adapters'; :meth:`moment_sets` indexes the layout's parameters (what the
    checkpoint saves and resumes)."""

    def __init__(self, inner, index: Sequence[int]):
        self.inner = inner
        self.index = list(index)

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    def step(self, grads: Sequence[Any], lr: Optional[float] = None, grad_scale: float = 1.0) -> None:
        self.inner.step([grads[i] for i in self.index], lr=lr, grad_scale=grad_scale)

    def moment_sets(self):
        return [(kind, [self.index[j] for j in idx], tensors) for kind, idx, tensors in self.inner.moment_sets()]

    def state_bytes(self) -> int:
        return self.inner.state_bytes()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def adapter_config(cfg: MindTrainConfig, adapted: Sequence[str]) -> dict:
    """PEFT's adapter_config.json of this run (``adapted``: the adapted weights' names), with
    ``mindtrain_layout``: the names of adapter_model.safetensors ("mindtrain": PEFT's,
    "mindformers": MindFormers')."""
    lc = cfg.lora_config
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.lora_rank, "lora_alpha": lc.lora_alpha,
            "lora_dropout": lc.lora_dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted({n[:-len(".weight")] for n in adapted}),
            "base_model_name_or_path": None, "inference_mode": True,
            "mindformers_target_modules": lc.target_modules, "mindformers_exclude_layers": lc.exclude_layers,
            "mindtrain_layout": cfg.checkpoint.layout}


def with_shared_a(adapters: dict, model_cfg: Any) -> dict:
    """``adapters`` (mindtrain's names, as the model holds them) with a ``lora_a`` for every
    ``lora_b``: a fused layer's later parts get the first part's (what they multiply by)."""
    out = dict(adapters)
    for name in adapters:
        if name.endswith(".lora_b") and name[:-1] + "a" not in adapters:
            out[name[:-1] + "a"] = adapters[_first_part(name, model_cfg)[:-1] + "a"]
    return out


def _first_part(name: str, model_cfg: Any) -> str:
    """The adapter of the first part (the holder of ``lora_a``) of the fused layer of adapter ``name``."""
    from mindtrain.trainer.mindformers_names import parts

    theirs = locate(name, model_cfg)[0]
    return parts(theirs[:-len(".lora_b")] + ".lora_a", (1, 1), model_cfg)[0][0]


def save_adapters(path: str, full: dict, config: dict, model_cfg: Any = None) -> None:
    """Write ``path``/adapter_model.safetensors (float32) and adapter_config.json. ``full``: the
    adapters by mindtrain's names, as the model holds them; written under PEFT's names (each part
    of a fused layer with its ``lora_a``), or with ``config["mindtrain_layout"]`` "mindformers"
    under MindFormers' names and fused shapes (``model_cfg``: the model config)."""
    from mindtrain.trainer import sharded

    os.makedirs(path, exist_ok=True)
    if config.get("mindtrain_layout") == "mindformers":
        from mindtrain.trainer.mindformers_names import to_mindformers

        named = to_mindformers(full, model_cfg)
    else:
        named = {peft_name(n): a for n, a in with_shared_a(full, model_cfg).items()} if model_cfg is not None \
            else {peft_name(n): a for n, a in full.items()}
    lazies = [sharded.Lazy(n, tuple(a.shape), np.dtype(np.float32),
                           (lambda a=a: np.ascontiguousarray(a, np.float32))) for n, a in sorted(named.items())]
    sharded.write_lazy(os.path.join(path, ADAPTER_FILE), lazies, metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def merge(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scaling: float) -> np.ndarray:
    """``weight + scaling * b @ a`` in float32 (PEFT's merge of a LoRA layer)."""
    return (weight.astype(np.float32) + np.float32(scaling) * (b.astype(np.float32) @ a.astype(np.float32))
            ).astype(np.float32)


def load_adapters(path: str, model_cfg: Any = None) -> tuple[dict, float]:
    """``(adapters by mindtrain name, scaling alpha / r)`` of a directory :func:`save_adapters`
    wrote (or PEFT's save_pretrained of a LoRA on the HF model): every adapted weight's
    ``lora_a`` and ``lora_b`` (a fused layer's shared ``lora_a`` under each part's name), what
    :func:`merge` takes per weight. MindFormers' names need ``model_cfg`` (the model config)."""
    from safetensors.numpy import load_file

    from mindtrain.trainer.mindformers_names import from_mindformers, uses_mindformers_names

    with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
        conf = json.load(f)
    tensors = load_file(os.path.join(path, ADAPTER_FILE))
    scaling = float(conf["lora_alpha"]) / float(conf["r"])
    if not uses_mindformers_names(tensors):
        return {from_peft_name(k): v for k, v in tensors.items()}, scaling
    if model_cfg is None:
        raise ValueError("adapters under MindFormers' names need the model config")
    return with_shared_a(from_mindformers(tensors, model_cfg), model_cfg), scaling


__all__ = ["AdapterOptimizer", "adapter_config", "apply_lora", "from_peft_name", "load_adapters",
           "merge", "mindformers_path", "peft_name", "save_adapters", "select_layers", "with_shared_a"]
