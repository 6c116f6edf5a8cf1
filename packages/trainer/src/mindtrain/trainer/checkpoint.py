"""Checkpoint folders: safetensors + JSON, one folder per step, atomic, newest K kept.

Layout under ``save_path``::

    iter_0000005/            model.safetensors (HF names), optimizer*.safetensors,
                             trainer_state.json, ...
    latest_checkpointed_iteration.txt     the step of the newest complete folder

Every rank writes its own files into a hidden temporary folder; once all have finished,
rank 0 renames it into place and only then rewrites the tracker (write + rename), so a
crash at any point leaves the previous checkpoint and the tracker pointing at it intact.
Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Optional

import numpy as np
from safetensors.numpy import load_file, save_file

from mindtrain.config import UserError

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
_FOLDER = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(UserError):
    """A checkpoint to load is missing, incomplete or does not fit this run."""


def folder_name(step: int) -> str:
    return f"iter_{step:07d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_tensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """safetensors file of contiguous arrays, fsynced."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def save_json(path: str, obj: Any) -> None:
    _write_bytes_durably(path, json.dumps(obj, indent=1, sort_keys=True).encode())


class CheckpointWriter:
    """Writes checkpoint folders for one rank of a job.

    ``barrier`` synchronises all ranks (a no-op for a single process).
    """

    def __init__(self, save_path: str, keep_last: int = 0, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None):
        self.save_path = save_path
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier

    def save(self, step: int, tensors: dict[str, dict[str, np.ndarray]],
             json_files: Optional[dict[str, Any]] = None) -> str:
        """Write this rank's files for ``step``; call on every rank. Returns the folder.

        ``tensors`` maps file name -> {tensor name: array}; ``json_files`` maps file name ->
        JSON-serialisable object. Ranks must use distinct file names.
        """
        final = os.path.join(self.save_path, folder_name(step))
        tmp = os.path.join(self.save_path, f".tmp_{folder_name(step)}")
        if self.rank == 0:
            os.makedirs(self.save_path, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.barrier()
        for name, arrays in tensors.items():
            save_tensors(os.path.join(tmp, name), arrays)
        for name, obj in (json_files or {}).items():
            save_json(os.path.join(tmp, name), obj)
        self.barrier()
        if self.rank == 0:
            _fsync_dir(tmp)
            if os.path.exists(final):  # the same step saved again (e.g. after a resume)
                old = os.path.join(self.save_path, f".old_{folder_name(step)}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.save_path)
            tracker_tmp = os.path.join(self.save_path, f".{TRACKER}.tmp")
            _write_bytes_durably(tracker_tmp, f"{step}\n".encode())
            os.replace(tracker_tmp, os.path.join(self.save_path, TRACKER))
            _fsync_dir(self.save_path)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        steps = sorted(saved_steps(self.save_path))
        for step in steps[:-self.keep_last]:
            shutil.rmtree(os.path.join(self.save_path, folder_name(step)), ignore_errors=True)


def saved_steps(save_path: str) -> list[int]:
    """Steps of the complete checkpoint folders under ``save_path``."""
    if not os.path.isdir(save_path):
        return []
    return sorted(int(m.group(1)) for m in map(_FOLDER.match, os.listdir(save_path)) if m)


def resolve_checkpoint(load_path: str) -> tuple[str, str]:
    """('checkpoint', folder) for a checkpoint folder or a save_path with a tracker file,
    ('hf', folder) for a Hugging Face model directory (one with config.json)."""
    if not os.path.isdir(load_path):
        raise CheckpointError(f"checkpoint.load_path: '{load_path}' is not a folder; "
                              "give a checkpoint folder, its parent with the tracker file, or an HF model directory")
    tracker = os.path.join(load_path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if not text.isdigit():
            raise CheckpointError(f"checkpoint.load_path: tracker file '{tracker}' does not hold a step number")
        folder = os.path.join(load_path, folder_name(int(text)))
        if not os.path.isfile(os.path.join(folder, STATE_FILE)):
            raise CheckpointError(f"checkpoint.load_path: tracker '{tracker}' names '{folder}', which is not a complete checkpoint")
        return "checkpoint", folder
    if os.path.isfile(os.path.join(load_path, STATE_FILE)):
        return "checkpoint", load_path
    if os.path.isfile(os.path.join(load_path, "config.json")):
        return "hf", load_path
    raise CheckpointError(f"checkpoint.load_path: '{load_path}' holds no {STATE_FILE}, no {TRACKER} and no config.json; "
                          "point it at a checkpoint folder (iter_NNNNNNN), the save_path holding the tracker, or an HF model directory")


def load_tensors(folder: str, name: str) -> dict[str, np.ndarray]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint.load_path: '{path}' is missing; the checkpoint is incomplete or was saved by a different layout")
    return load_file(path)


def load_json(folder: str, name: str = STATE_FILE) -> Any:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint.load_path: '{path}' is missing; the checkpoint is incomplete")
    with open(path, encoding="utf-8") as f:
        return json.load(f)
