"""MindFormers' PyNative checkpoint layout (``mindformers/checkpoint/``), read and written.

Layout under ``save_path``::

    latest_checkpointed_iteration.txt          the newest complete iteration, e.g. ``5``
    iteration_00000005/
        {prefix}-model-{rank:07d}-{world:07d}.safetensors   parameters, MindFormers' PyNative names
        {prefix}-opt-{rank:07d}-{world:07d}.safetensors     adam_m.<name>, adam_v.<name>, global_step
        common.json        CommonInfo: epoch_num, step_num, global_step, loss_scale,
                           global_batch_size, consumed_samples, ckpt_status
        metadata.json      per tensor: global shape and the chunks (global_offset,
                           local_shape) each file holds ("state_dict_metadata"), and which
                           file stores each chunk ("storage_data")

A checkpoint without ``metadata.json`` holds full tensors (MindFormers writes none for one
card). This module uses numpy, safetensors and json only.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
from mindtrain.config import UserError

from mindtrain.trainer import mindformers_names as names
from mindtrain.trainer import sharded

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
METADATA_FILE = "metadata.json"
FOLDER = re.compile(r"^iteration_(\d{8,})$")
_FILE = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<rank>\d{7})-(?P<world>\d{7})\.safetensors$")
# MindFormers' AdamW names its moments after the model parameter: adam_m.<name>, adam_v.<name>
MOMENTS = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq"}

def folder_name(step: int) -> str:
    return f"iteration_{step:08d}"


def file_name(prefix: Optional[str], kind: str, rank: int, world: int) -> str:
    """``{prefix}-{model|opt}-{rank:07d}-{world:07d}.safetensors`` (no prefix part when None)."""
    body = f"{kind}-{rank:07d}-{world:07d}.safetensors"
    return f"{prefix}-{body}" if prefix else body


def is_checkpoint_folder(folder: str) -> bool:
    """A MindFormers iteration folder: common.json plus at least one model file."""
    if not os.path.isfile(os.path.join(folder, COMMON_FILE)):
        return False
    return any((m := _FILE.match(f)) and m.group("kind") == "model" for f in os.listdir(folder))


def common_info(step: int, total_steps: int, global_batch_size: int, consumed_samples: int) -> dict[str, Any]:
    """common.json as MindFormers' CheckpointCallback fills CommonInfo (step_num is max_steps)."""
    return {"epoch_num": 1, "step_num": total_steps, "global_step": step, "loss_scale": 1.0,
            "global_batch_size": global_batch_size, "consumed_samples": consumed_samples, "ckpt_status": None}


def metadata(files: dict[str, dict[str, np.ndarray]], world: int) -> dict[str, Any]:
    """metadata.json for files of full (unsharded) tensors: one chunk per tensor at offset 0,
    stored once, in the file that holds it, for every rank of the job."""
    pieces, file_of = [], {}
    for fname, tensors in files.items():
        for name, a in tensors.items():
            shape = tuple(np.shape(a))
            piece = sharded.Piece("model", name, shape, (0,) * len(shape), shape, np.asarray(a).dtype.name)
            pieces.append(piece)
            file_of[piece.key] = fname
    return sharded.metadata(pieces, lambda p: file_of[p.key], world)


_shard_id = sharded.shard_id
_parse_shard_id = sharded.parse_shard_id
damaged_message = sharded.damaged_message


def read_tracker(save_path: str) -> Optional[int]:
    path = os.path.join(save_path, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text.isdigit():
        raise UserError(f"checkpoint.load_path: tracker file '{path}' does not hold an iteration number")
    return int(text)


def read_checkpoint(folder: str, workers: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(model tensors, optimizer tensors, common.json) of a MindFormers iteration folder, every
    tensor at full shape. Sharded checkpoints are assembled from metadata.json's chunks;
    ``workers`` threads read the files."""
    common = read_json(os.path.join(folder, COMMON_FILE))
    kinds = {f: m.group("kind") for f in sorted(os.listdir(folder)) if (m := _FILE.match(f))}
    meta_path = os.path.join(folder, METADATA_FILE)
    if os.path.isfile(meta_path):
        meta = read_json(meta_path)
        tensors = _assemble(folder, meta, workers)
        out = {"model": {}, "opt": {}}
        file_of = {}
        for key, stores in meta["storage_data"].items():
            file_of.setdefault(_parse_shard_id(key)[0], stores[0]["file_name"])
        for name, a in tensors.items():
            kind = kinds.get(file_of.get(name, ""), "model")
            out[kind][name] = a
        return out["model"], out["opt"], common
    out = {"model": {}, "opt": {}}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for fname, arrays in zip(kinds, pool.map(lambda f: _read_all(os.path.join(folder, f)), kinds)):
            out[kinds[fname]].update(arrays)
    return out["model"], out["opt"], common


def _read_all(path: str) -> dict[str, np.ndarray]:
    return read_safetensors(path)


def _assemble(folder: str, meta: dict, workers: int) -> dict[str, np.ndarray]:
    """Full tensors from metadata.json: each chunk read from the first file that stores it."""
    wanted: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for key, stores in meta["storage_data"].items():
        name, offset = _parse_shard_id(key)
        wanted.setdefault(stores[0]["file_name"], []).append((name, offset))
    missing = [f for f in wanted if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise UserError(f"checkpoint.load_path: '{os.path.join(folder, missing[0])}' is named in metadata.json "
                        "but missing; the checkpoint is incomplete")

    def read(fname: str) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
        arrays = read_safetensors(os.path.join(folder, fname), sorted({name for name, _ in wanted[fname]}))
        return [(name, offset, arrays[name]) for name, offset in wanted[fname]]

    full: dict[str, np.ndarray] = {}
    covered: dict[str, int] = {}
    states = meta["state_dict_metadata"]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for pieces in pool.map(read, list(wanted)):
            for name, offset, piece in pieces:
                shape = tuple(states[name]["global_shape"]) if name in states else piece.shape
                covered[name] = covered.get(name, 0) + piece.size
                if piece.shape == tuple(shape):
                    full[name] = piece
                    continue
                if name not in full:
                    full[name] = np.zeros(shape, piece.dtype)
                index = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
                full[name][index] = piece
    for name, a in full.items():
        if covered[name] != a.size:
            raise UserError(f"checkpoint.load_path: the chunks of '{name}' in {folder}/metadata.json cover "
                            f"{covered[name]} of its {a.size} elements; the checkpoint is incomplete")
    return full



def read_json(path: str) -> Any:
    """A checkpoint's JSON file; unreadable JSON is the damaged-file line."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(damaged_message(path, err)) from None


def read_safetensors(path: str, names: Optional[list[str]] = None) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file (all, or ``names``), BF16 read as float32. Parsed from
    the header directly: numpy has no bfloat16, so safetensors' numpy reader refuses BF16."""
    header, base = sharded.read_header(path)
    with open(path, "rb") as f:
        out = {}
        for name in (names if names is not None else list(header)):
            if name not in header:
                raise UserError(f"checkpoint.load_path: '{path}' holds no tensor '{name}' although metadata.json "
                                "says it does; the checkpoint is damaged")
            info = header[name]
            start, end = info["data_offsets"]
            f.seek(base + start)
            raw = f.read(end - start)
            if len(raw) != end - start:
                raise UserError(damaged_message(path, ValueError(f"'{name}' needs {end - start} bytes, "
                                                                 f"{len(raw)} are left")))
            if info["dtype"] == "BF16":
                a = sharded.bf16_to_float32(np.frombuffer(raw, np.uint16))
            elif info["dtype"] in sharded.ST_DTYPES:
                a = np.frombuffer(raw, sharded.ST_DTYPES[info["dtype"]]).copy()
            else:
                raise UserError(f"checkpoint.load_path: '{path}' stores '{name}' as {info['dtype']}, "
                                "which mindtrain does not read (float/int types and BF16 are read)")
            out[name] = a.reshape(info["shape"])
    return out


def checkpoint_files(weights: dict[str, np.ndarray], optimizer_state: Optional[dict[str, np.ndarray]],
                     prefix: Optional[str], world: int, common: dict[str, Any], model_config: Any = None
                     ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """Rank 0's files of a checkpoint of full-shape tensors: the model file, the optimizer
    file (mindtrain's ``exp_avg.<n>`` / ``exp_avg_sq.<n>`` / ``step`` renamed as MindFormers'
    AdamW names them), common.json and metadata.json. Every tensor is stored once. With
    ``model_config``, parameters and moments take MindFormers' PyNative DeepSeek-V3 names and
    layouts (mindformers_names.py); without, the network's own names."""
    def rename(t: dict[str, np.ndarray], buffers: bool = False) -> dict[str, np.ndarray]:
        return t if model_config is None else names.to_mindformers(t, model_config, buffers)

    tensors = {file_name(prefix, "model", 0, world): rename(dict(weights), True)}
    if optimizer_state is not None:
        opt = {"global_step": np.asarray(optimizer_state["step"], np.int64).reshape(1)}
        for theirs, ours in MOMENTS.items():
            moments = {key[len(ours) + 1:]: a for key, a in optimizer_state.items() if key.startswith(ours + ".")}
            opt.update({f"{theirs}.{n}": a for n, a in rename(moments).items()})
        tensors[file_name(prefix, "opt", 0, world)] = opt
    return tensors, {COMMON_FILE: common, METADATA_FILE: metadata(tensors, world)}


def network_tensors(model: dict[str, np.ndarray], opt: dict[str, np.ndarray], model_config: Any
                    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(model tensors, optimizer tensors) of :func:`read_checkpoint` under the network's own
    names: mapped back from MindFormers' PyNative names when the files use them (MindFormers,
    or mindtrain since the name map), as they are otherwise (mindtrain before it)."""
    if not names.uses_mindformers_names(model):
        return model, opt
    out = {k: a for k, a in opt.items() if not k.startswith(tuple(f"{m}." for m in MOMENTS))}
    for theirs in MOMENTS:
        moments = {k[len(theirs) + 1:]: a for k, a in opt.items() if k.startswith(theirs + ".")}
        out.update({f"{theirs}.{n}": a for n, a in names.from_mindformers(moments, model_config).items()})
    return names.from_mindformers(model, model_config), out


def to_mindtrain_state(opt: dict[str, np.ndarray], common: dict[str, Any], param_names: list[str],
                       global_batch_size: int, folder: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(optimizer state as AdamW.state_dict keys it, trainer state) from a MindFormers
    optimizer file and common.json. The data position comes from consumed_samples, or
    global_step x global_batch_size when the checkpoint predates that field (as MindFormers)."""
    saved: dict[str, np.ndarray] = {}
    if "global_step" in opt:
        saved["step"] = np.asarray(opt["global_step"]).reshape(()).astype(np.int64)
    for theirs, ours in MOMENTS.items():
        for n in param_names:
            if f"{theirs}.{n}" not in opt:
                raise UserError(f"checkpoint.load_path: the optimizer files of {folder} hold no '{theirs}.{n}'; "
                                "they do not match this model (set checkpoint.no_load_optim: true to load the "
                                "weights only)")
            saved[f"{ours}.{n}"] = opt[f"{theirs}.{n}"]
    step = int(common["global_step"])
    consumed = common.get("consumed_samples")
    if consumed is None:
        consumed = step * int(common.get("global_batch_size") or global_batch_size)
    state = {"step": step, "consumed_samples": int(consumed), "skipped_total": 0, "skipped_in_row": 0}
    return saved, state
