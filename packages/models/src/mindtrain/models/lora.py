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
"""

from __future__ import annotations

import contextlib
from typing import Iterator

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


def add_adapter(cell: Linear, rank: int, alpha: float, a_std: float, b_std: float, empty: bool) -> None:
    """Give ``cell`` its adapter (see the module doc); ``empty``: without storage, as a
    model built by :func:`~mindtrain.models.build_model` (a layout gives the values)."""
    prefix = cell.weight.name[:-len(".weight")]
    b_init = Init("normal", b_std) if b_std > 0 else Init("zeros")
    with empty_weights() if empty else contextlib.nullcontext():
        a = new_weight((rank, cell.in_features), Init("normal", a_std), prefix + ".lora_a")
        b = new_weight((cell.out_features, rank), b_init, prefix + ".lora_b")
    cell.lora_a = a
    cell.lora_b = b
    a.name, b.name = prefix + ".lora_a", prefix + ".lora_b"  # the full names (setattr names them short)
    cell.lora_scaling = float(alpha) / float(rank)


__all__ = ["SUFFIXES", "add_adapter", "base_weight", "is_adapter", "linear_layers"]
