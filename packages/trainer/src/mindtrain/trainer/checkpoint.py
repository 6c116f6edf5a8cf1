"""Checkpoint folders: safetensors + JSON, one folder per step, atomic, newest K kept.

Two layouts under ``save_path`` (``checkpoint.layout``)::

    mindtrain (default)                  mindformers
    iter_0000005/                        iteration_00000005/
      model.safetensors (HF names),        {prefix}-model-0000000-{world:07d}.safetensors,
      config.json: an HF model directory   {prefix}-opt-..., common.json, metadata.json
      optimizer.safetensors,               (mindformers_checkpoint.py)
      trainer_state.json, rank_*.json      + config.json, trainer_state.json, rank_*.json
    latest_checkpointed_iteration.txt    the step of the newest complete folder

Every rank writes its own files into a hidden temporary folder; once all have finished,
rank 0 renames it into place and only then rewrites the tracker (write + rename), so a
crash at any point leaves the previous checkpoint and the tracker pointing at it intact.
With ``async_save`` the files are written by a background thread from host copies while
training goes on; the rename and tracker wait for the next save or the end of training.
Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from typing import Any, Callable, Optional

import numpy as np
from safetensors.numpy import load_file, save_file

from mindtrain.config import UserError
from mindtrain.trainer import mindformers_checkpoint as mf

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
_FOLDER = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(UserError):
    """A checkpoint to load is missing, incomplete or does not fit this run."""


LAYOUTS = ("mindtrain", "mindformers")


def folder_name(step: int, layout: str = "mindtrain") -> str:
    return mf.folder_name(step) if layout == "mindformers" else f"iter_{step:07d}"


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

    ``barrier`` synchronises all ranks (a no-op for a single process). ``keep_last`` keeps
    the newest that many folders this writer saved (0: all); as in MindFormers, folders of
    earlier runs are never deleted. With ``async_save`` a background thread writes this
    rank's files; :meth:`wait` (called by the next save, and by the trainer at the end)
    joins it and publishes the folder.
    """

    def __init__(self, save_path: str, keep_last: int = 0, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], None] = lambda: None, layout: str = "mindtrain", async_save: bool = False):
        self.save_path = save_path
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier
        self.layout = layout
        self.async_save = async_save
        self.saved: list[int] = []  # steps this writer published, oldest first
        self._pending: Optional[tuple[int, threading.Thread, list]] = None

    def save(self, step: int, tensors: dict[str, dict[str, np.ndarray]],
             json_files: Optional[dict[str, Any]] = None) -> str:
        """Write this rank's files for ``step``; call on every rank. Returns the folder.

        ``tensors`` maps file name -> {tensor name: array}; ``json_files`` maps file name ->
        JSON-serialisable object. Ranks must use distinct file names.
        """
        self.wait()
        final = os.path.join(self.save_path, folder_name(step, self.layout))
        tmp = self._tmp(step)
        if self.rank == 0:
            os.makedirs(self.save_path, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.barrier()
        if not self.async_save:
            _write_files(tmp, tensors, json_files or {})
            self._publish(step)
            return final
        # host copies first: training may overwrite the arrays it handed over
        tensors = {f: {k: np.array(v, copy=True) for k, v in arrays.items()} for f, arrays in tensors.items()}
        json_files = json.loads(json.dumps(json_files or {}))
        errors: list = []

        def write() -> None:
            try:
                _write_files(tmp, tensors, json_files)
            except BaseException as e:  # re-raised on the training thread by wait()
                errors.append(e)

        thread = threading.Thread(target=write, name="mindtrain-async-save", daemon=True)
        thread.start()
        self._pending = (step, thread, errors)
        return final

    def wait(self) -> None:
        """Finish an asynchronous save: join its thread, then publish the folder (all ranks)."""
        if self._pending is None:
            return
        step, thread, errors = self._pending
        self._pending = None
        thread.join()
        if errors:
            raise errors[0]
        self._publish(step)

    def _tmp(self, step: int) -> str:
        return os.path.join(self.save_path, f".tmp_{folder_name(step, self.layout)}")

    def _publish(self, step: int) -> None:
        """Rename the finished temporary folder into place, then the tracker; prune."""
        self.barrier()
        name = folder_name(step, self.layout)
        final = os.path.join(self.save_path, name)
        if self.rank == 0:
            tmp = self._tmp(step)
            _fsync_dir(tmp)
            if os.path.exists(final):  # the same step saved again (e.g. after a resume)
                old = os.path.join(self.save_path, f".old_{name}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.save_path)
            tracker_tmp = os.path.join(self.save_path, f".{TRACKER}.tmp")
            # MindFormers writes str(iteration) without a newline
            _write_bytes_durably(tracker_tmp, f"{step}".encode() if self.layout == "mindformers" else f"{step}\n".encode())
            os.replace(tracker_tmp, os.path.join(self.save_path, TRACKER))
            _fsync_dir(self.save_path)
        if step in self.saved:
            self.saved.remove(step)
        self.saved.append(step)
        if self.rank == 0:
            self._prune()
        self.barrier()

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        while len(self.saved) > self.keep_last:
            step = self.saved.pop(0)
            shutil.rmtree(os.path.join(self.save_path, folder_name(step, self.layout)), ignore_errors=True)


def save_notes(ck) -> list[str]:
    """Start-up lines for checkpoint options that act differently in the chosen layout."""
    notes = []
    if ck.enable_save and ck.layout == "mindtrain" and ck.prefix != "checkpoint":
        notes.append(f"checkpoint.prefix {ck.prefix!r} names files in checkpoint.layout: mindformers only; "
                     "the mindtrain layout names them model.safetensors / optimizer.safetensors "
                     "(an HF model directory)")
    return notes


def _write_files(folder: str, tensors: dict[str, dict[str, np.ndarray]], json_files: dict[str, Any]) -> None:
    for name, arrays in tensors.items():
        save_tensors(os.path.join(folder, name), arrays)
    for name, obj in json_files.items():
        save_json(os.path.join(folder, name), obj)


def saved_steps(save_path: str) -> list[int]:
    """Steps of the complete checkpoint folders (either layout) under ``save_path``."""
    if not os.path.isdir(save_path):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(save_path)
                  for m in (_FOLDER.match(name) or mf.FOLDER.match(name),) if m)


def resolve_checkpoint(load_path: str) -> tuple[str, str]:
    """(kind, folder): 'checkpoint' for a mindtrain folder, 'mindformers' for a MindFormers
    iteration folder (either given directly or named by the tracker file of the folder
    holding it, as MindFormers resolves it), 'hf' for a Hugging Face model directory."""
    if not os.path.isdir(load_path):
        raise CheckpointError(f"checkpoint.load_path: '{load_path}' is not a folder; "
                              "give a checkpoint folder, its parent with the tracker file, or an HF model directory")
    tracker = os.path.join(load_path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if not text.isdigit():
            raise CheckpointError(f"checkpoint.load_path: tracker file '{tracker}' does not hold a step number")
        step = int(text)
        ours, theirs = (os.path.join(load_path, folder_name(step, layout)) for layout in LAYOUTS)
        if os.path.isfile(os.path.join(ours, STATE_FILE)):
            return "checkpoint", ours
        if os.path.isdir(theirs) and mf.is_checkpoint_folder(theirs):
            return "mindformers", theirs
        raise CheckpointError(f"checkpoint.load_path: tracker '{tracker}' names iteration {step}, which is not a "
                              f"complete checkpoint (looked for '{ours}' and '{theirs}')")
    if os.path.isfile(os.path.join(load_path, STATE_FILE)) and not mf.is_checkpoint_folder(load_path):
        return "checkpoint", load_path
    if mf.is_checkpoint_folder(load_path):
        return "mindformers", load_path
    if os.path.isfile(os.path.join(load_path, "config.json")):
        return "hf", load_path
    raise CheckpointError(f"checkpoint.load_path: '{load_path}' holds no {STATE_FILE}, no {TRACKER}, no MindFormers "
                          f"{mf.COMMON_FILE} with model files and no config.json; point it at a checkpoint folder "
                          "(iter_NNNNNNN or iteration_NNNNNNNN), the save_path holding the tracker, or an HF model directory")


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
