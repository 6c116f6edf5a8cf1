"""One rank's share of the model: built without memory, laid out, then given values.

The model is built on MindSpore's meta device (no storage); the layout
(:func:`mindtrain.parallel.parallelize`) narrows each parameter to this rank's piece (its
pipeline stage's layers, TP slice, FSDP shard, experts) while they are still empty; only then
are the pieces given values: read from a sharded checkpoint of either layout (only the parts
of its files that overlap them; MindFormers' fused tensors included), read likewise from an HF
model directory, or made from the model's initial values, which are the same numbers whichever
piece a rank makes. Other stages' layers are never given storage. A folder of the earlier
full-tensor mindtrain form is loaded whole before the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mindtrain.config import MindTrainConfig, ParallelDims
from mindtrain.trainer import checkpoint as ckpt
from mindtrain.trainer.max_logits import wants_max_logits


@dataclass
class Share:
    """What :func:`build_share` made: the model, its parallel plan (full shapes), its layout,
    the model's parameters by name (taken before the layout wrapped layers), its untrained
    ones (``buffers``, whole on every rank) and the checkpoint state still to restore
    (optimizer, data position), if any."""

    model: Any
    plan: Any
    layout: Any
    params: dict
    buffers: list
    resume: Optional[ckpt.Resume]
    adapted: list = None
    """The weights ``lora_config`` gave adapters (None without it)."""


def build_share(cfg: MindTrainConfig, dims: ParallelDims, rank: int, checkpointer: ckpt.Checkpointer,
                compute_dtype: Optional[str], accumulation: int, columns: Sequence[str],
                connect: bool = True) -> Share:
    """This rank's share (see the module doc). ``connect=False`` lays out without creating
    the mesh's process groups: a dry build of any rank of any world size in one process,
    which must then not communicate (ZeRO-3 or no data-parallel sharding, a pipeline stage
    that holds no tied weight)."""
    from mindtrain.models import build_model, parallel_plan
    from mindtrain.parallel import DeviceMesh, parallelize

    seed = cfg.training.seed
    load_path = cfg.checkpoint.load_path
    empty = not load_path or ckpt.loads_by_pieces(load_path)
    model = build_model(cfg.model, jit=cfg.compile.enable, compute_dtype=compute_dtype, recompute=cfg.recompute,
                        empty=empty, seed=seed)
    adapted = None
    if cfg.lora_config is not None:  # adapters before anything reads the parameter list
        from mindtrain.trainer.lora import apply_lora

        adapted = apply_lora(model, cfg, empty)
    if wants_max_logits(cfg):  # before the first (compiled) call
        from mindtrain.models.attention import track_max_attention_logits

        track_max_attention_logits(model)
    # an unwritable save_path or one without room is said now, not at the first save
    checkpointer.check_storage(sum(math.prod(p.shape) * 4 for p in model.get_parameters()))
    # a full-tensor checkpoint loads into the whole model here; a sharded one or an HF
    # directory is checked here and read piece by piece below
    resume = checkpointer.load_weights(model) if load_path else None
    params = {p.name: p for p in model.get_parameters()}
    plan = parallel_plan(model)
    buffers = [(n, params[n]) for n, info in plan.params.items() if not info.trainable and n in params]
    if empty:
        checkpointer.fill_buffers(buffers, seed)
    mesh = DeviceMesh(dims, rank)
    layout = parallelize(model, plan, mesh, cfg, accumulation=accumulation, columns=columns, connect=connect)
    if empty:
        checkpointer.fill_layout(layout, params, seed)
    return Share(model, plan, layout, params, buffers, resume, adapted)

