"""``mindtrain-export-hf CHECKPOINT OUT``: a sharded checkpoint folder (either layout) as an HF
model directory.

Tensor by tensor: each HF tensor (one routed expert of a stacked weight, say) is read from
the pieces that hold it and written before the next is read, so the memory it takes is the
largest HF tensor's, whatever the model's size. The directory is what ``from_pretrained``
(mindtrain's and transformers') reads: config.json, safetensors shards and their index.

``--lora ADAPTERS``: a LoRA run's adapters (the directory a save writes under
``save_path``/lora/iter_NNNNNNN, under PEFT's names or MindFormers' (``checkpoint.layout:
mindformers``), or PEFT's ``save_pretrained`` of a LoRA on the HF model:
adapter_model.safetensors + adapter_config.json) merged into the weights, as PEFT's
``merge_and_unload``: ``W + (lora_alpha / r) * B @ A``. The checkpoint's own adapter tensors
are never exported; a checkpoint that holds some needs ``--lora``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from mindtrain.config import UserError
from mindtrain.trainer import mindformers_checkpoint as mf
from mindtrain.trainer import sharded

MAX_SHARD_BYTES = 2 * 1024 ** 3
_OPTIMIZER = ("exp_avg.", "exp_avg_sq.", "muon_m.")  # AdamW moments, Muon momentum buffers


def export_hf(folder: str, out: str, max_shard_bytes: int = MAX_SHARD_BYTES, lora: Optional[str] = None
              ) -> list[str]:
    """Write the HF model directory ``out`` from the sharded checkpoint ``folder`` (``lora``:
    an adapter directory merged into the weights); returns the safetensors files written."""
    from mindtrain.models.lora import base_weight, is_adapter
    from mindtrain.models.hf_checkpoint import hf_copies, hf_tensor_names, write_hf_directory
    from mindtrain.models.hf_config import config_from_hf, refuse_without_hf_equivalent

    mindformers = mf.is_checkpoint_folder(folder)
    if not mindformers and not sharded.is_sharded(folder):
        raise UserError(f"{folder}: no {sharded.METADATA_FILE}; give a sharded checkpoint folder (iter_NNNNNNN "
                        "or iteration_NNNNNNNN)")
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"{config_path}: missing; the checkpoint folder is incomplete")
    with open(config_path, encoding="utf-8") as f:
        hf_config = json.load(f)
    model_config = config_from_hf(hf_config)
    refuse_without_hf_equivalent(model_config)  # e.g. qk_layernorm: false
    # checkpoint.layout: mindformers: MindFormers' fused tensors read as the network's
    reader = (mf.MindFormersBoxes(folder, mf.with_stored_mtp(model_config, folder)) if mindformers
              else sharded.ShardedReader(folder))
    adapters, scaling = ({}, 0.0)
    if lora is not None:
        from mindtrain.trainer.lora import load_adapters

        try:
            adapters, scaling = load_adapters(lora, model_config)
        except (OSError, KeyError, ValueError) as err:
            raise UserError(f"--lora {lora}: not a LoRA adapter directory (adapter_model.safetensors + "
                            f"adapter_config.json): {err}") from None
    elif any(is_adapter(n) for n in reader.names()):
        raise UserError(f"{folder} holds LoRA adapters: pass --lora with their directory (save_path/lora/"
                        "iter_NNNNNNN) to merge them into the weights")
    merges = {}
    for name in sorted(n for n in adapters if n.endswith(".lora_a")):
        weight = base_weight(name)
        if weight not in reader.global_shapes or name[:-1] + "b" not in adapters:
            raise UserError(f"--lora {lora}: adapter {name} has no weight {weight} in {folder} (or no lora_b)")
        merges[weight] = (adapters[name], adapters[name[:-1] + "b"])
    entries: list[sharded.Lazy] = []
    source: dict[str, tuple[str, Optional[int]]] = {}
    for name in reader.names():
        if name == "step" or name.startswith(_OPTIMIZER) or is_adapter(name):
            continue
        shape = reader.global_shapes[name]
        for hf_name, e in hf_tensor_names(name, shape, model_config.model_type):
            source[hf_name] = (name, e)
            if name in merges:
                a, b = merges[name]
                entries.append(_merged(reader, hf_name, name, shape, a, b, scaling))
            else:
                entries.append(_lazy(reader, hf_name, name, shape, e))
    for copy, src in hf_copies(model_config):
        if src in source:
            name, e = source[src]
            entries.append(_lazy(reader, copy, name, reader.global_shapes[name], e))
    by_name = {t.name: t for t in entries}

    def write(path: str, names: list[str]) -> None:
        sharded.write_lazy(path, [by_name[n] for n in names], metadata={"format": "pt"})

    return write_hf_directory(out, hf_config, {t.name: t.nbytes for t in entries}, write, max_shard_bytes)


def _merged(reader, hf_name: str, name: str, shape: tuple, a: np.ndarray, b: np.ndarray, scaling: float
            ) -> sharded.Lazy:
    from mindtrain.trainer.lora import merge

    return sharded.Lazy(hf_name, tuple(shape), np.dtype(np.float32),
                        lambda: merge(reader.read_full(name).astype(np.float32, copy=False), a, b, scaling))


def _lazy(reader: sharded.ShardedReader, hf_name: str, name: str, shape: tuple, expert: Optional[int]
          ) -> sharded.Lazy:
    if name.endswith(".tid2eid"):  # DeepSeek-V4's token -> experts table: integer ids in HF files
        return sharded.Lazy(hf_name, tuple(shape), np.dtype(np.int64),
                            lambda: reader.read_full(name).astype(np.int64))
    if expert is None:
        return sharded.Lazy(hf_name, tuple(shape), np.dtype(np.float32),
                            lambda: reader.read_full(name).astype(np.float32, copy=False))
    rest = tuple(shape[1:])
    return sharded.Lazy(hf_name, rest, np.dtype(np.float32),
                        lambda: reader.read(name, (expert,) + (0,) * len(rest), (1,) + rest)
                        .reshape(rest).astype(np.float32, copy=False))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mindtrain-export-hf", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint folder (iter_NNNNNNN, or iteration_NNNNNNNN of "
                                           "checkpoint.layout: mindformers)")
    parser.add_argument("out", help="the HF model directory to write")
    parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES,
                        help="largest safetensors file (default 2 GiB)")
    parser.add_argument("--lora", metavar="ADAPTERS", default=None,
                        help="merge these LoRA adapters into the weights: a directory with adapter_model.safetensors "
                             "and adapter_config.json (save_path/lora/iter_NNNNNNN of a lora_config run, or PEFT's)")
    args = parser.parse_args(argv)
    try:
        files = export_hf(args.checkpoint, args.out, args.max_shard_bytes, lora=args.lora)
    except UserError as err:
        print(f"mindtrain-export-hf: {err}", file=sys.stderr)
        return 2
    print(f"mindtrain-export-hf: wrote {args.out} ({len(files)} safetensors file{'s' if len(files) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
