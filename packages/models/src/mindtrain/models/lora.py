"""LoRA adapters on the model's :class:`~mindtrain.models.linear.Linear` layers.

An adapted layer keeps its frozen ``weight`` [out, in] and gains ``lora_a`` [r, in] and
``lora_b`` [out, r]; it multiplies by ``weight + (alpha / r) * lora_b @ lora_a``
(:meth:`Linear.merged_weight`), which is ``x W^T + (alpha / r) (x A^T) B^T`` of MindFormers'
``LinearWithLoRA`` (and PEFT's ``lora.Linear``) without dropout, computed merged: a step
costs about as much as full fine-tuning. With ``lora_dropout`` > 0
(:func:`mindtrain.models.dropout.attach_lora_dropout`) a training step runs the adapter
unmerged on its dropped input (:meth:`Linear.lora_input`). The adapters are named after the weight
(``<layer>.lora_a`` / ``<layer>.lora_b``, as MindFormers names them) and start as MindFormers'
``reset_parameter`` makes them: ``lora_a`` normal(0, lora_a_std), ``lora_b`` zeros (or
normal(0, lora_b_std) when that is > 0), from the model's seeded per-name generator, so every
rank makes the same numbers for any piece. Routed experts are stacked tensors, not Linear
layers: as in MindFormers, they get no adapter.

A layer MindFormers fuses (``linear_qkv``: q + kv of MLA, or Qwen3's q, k, v; ``linear_fc1``:
gate + up) is several Linear layers here; MindFormers' one adapter on the fused weight is
``lora_a`` [r, in] shared by the parts and ``lora_b`` [sum(out), r]. Here the first part holds
``lora_a`` and its rows of ``lora_b``, every other part only its rows of ``lora_b`` and
multiplies by the first part's ``lora_a`` (``add_adapter(..., share_a=first)``): the same
function and, since the shared factor is one parameter, the same gradients.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from mindtrain.models.linear import Linear
from mindtrain.models.weights import Init, empty_weights, new_weight

SUFFIXES = (".lora_a", ".lora_b")


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter (``lora_a`` / ``lora_b``)."""
    return name.endswith(SUFFIXES)


def base_weight(name: str) -> str:
    """The weight an adapter ``<layer>.lora_a`` / ``.lora_b`` belongs to: ``<layer>.weight``."""
    return name.rsplit(".", 1)[0] + ".weight"


def linear_layers(model) -> Iterator[tuple[str, Linear]]:
    """``(weight name, cell)`` of every Linear layer of ``model``, in cell order."""
    for _, cell in model.cells_and_names():
        if isinstance(cell, Linear):
            yield cell.weight.name, cell


def add_adapter(cell: Linear, rank: int, alpha: float, a_std: float, b_std: float, empty: bool,
                share_a: Optional[Linear] = None) -> None:
    """Give ``cell`` its adapter (see the module doc); ``empty``: without storage, as a
    model built by :func:`~mindtrain.models.build_model` (a layout gives the values).
    ``share_a``: the first part of the fused layer ``cell`` is a part of (adapted before it):
    ``cell`` gets only ``lora_b`` and multiplies by that part's ``lora_a``."""
    prefix = cell.weight.name[:-len(".weight")]
    b_init = Init("normal", b_std) if b_std > 0 else Init("zeros")
    if share_a is not None:
        if share_a.lora_scaling is None or share_a.in_features != cell.in_features:
            raise ValueError(f"{prefix}: cannot share the adapter input factor of {share_a.weight.name}")
        object.__setattr__(cell, "_lora_a_owner", share_a)  # not a sub-cell: its lora_a is the owner's parameter
    with empty_weights() if empty else contextlib.nullcontext():
        a = None if share_a is not None else new_weight((rank, cell.in_features), Init("normal", a_std),
                                                        prefix + ".lora_a")
        b = new_weight((cell.out_features, rank), b_init, prefix + ".lora_b")
    if a is not None:
        cell.lora_a = a
        a.name = prefix + ".lora_a"  # the full name (setattr names it short)
    cell.lora_b = b
    b.name = prefix + ".lora_b"
    cell.lora_scaling = float(alpha) / float(rank)


def a_owner(cell: Linear) -> Linear:
    """The layer whose ``lora_a`` ``cell``'s adapter multiplies by: ``cell``, or the first part
    of the fused layer it is a part of."""
    return cell.__dict__.get("_lora_a_owner") or cell


__all__ = ["SUFFIXES", "a_owner", "add_adapter", "base_weight", "is_adapter", "linear_layers"]
