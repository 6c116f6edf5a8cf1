"""Checkpoint folders: safetensors + JSON, one folder per step, atomic, newest K kept.

Two layouts under ``save_path`` (``checkpoint.layout``), both sharded::

    mindtrain (default)                   mindformers
    iter_0000005/                         iteration_00000005/
      model-{rank:07d}-{world:07d}          {prefix}-model-{rank:07d}-{world:07d}.safetensors,
        .safetensors (each rank's pieces),  {prefix}-opt-..., common.json, metadata.json
      opt-...safetensors (AdamW moments),   (mindformers_checkpoint.py; MindFormers' names
      metadata.json (MindFormers' format),  and fused tensors) + config.json,
      config.json, trainer_state.json,      trainer_state.json, rank_*.json
      rank_*.json
    latest_checkpointed_iteration.txt     the step of the newest complete folder

In both, every rank writes the pieces of the weights and moments it holds
(:mod:`mindtrain.trainer.sharded`; in the mindformers layout as boxes of MindFormers' fused
tensors): nothing is gathered, and a rank that loads reads only the parts of the files that
overlap its own pieces, in any layout and world size; MindFormers' own checkpoints load the
same way. ``mindtrain-export-hf`` turns a mindtrain folder into an HF model directory.
Folders of the earlier full-tensor form (``model.safetensors`` in HF names,
``optimizer.safetensors``) are still read.

:class:`Checkpointer` is the trainer's one door to checkpoints: it loads the weights (from a
checkpoint of either layout or an HF model directory, through mindtrain.models' one HF
reader), saves, and on resume reads back everything ``trainer_state.json`` holds and checks
it against this run (see :meth:`Checkpointer.load_state`).

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
import random
import re
import shutil
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
from safetensors.numpy import load_file

from mindtrain.config import UserError
from mindtrain.trainer import faults
from mindtrain.trainer import mindformers_checkpoint as mf
from mindtrain.trainer import sharded

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
_FOLDER = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(UserError):
    """A checkpoint to load is missing, incomplete or does not fit this run."""


class SaveFailed(Exception):
    """Writing one checkpoint failed on some rank (disk full, say); nothing was published,
    the previous checkpoint and the training state are untouched."""

    def __init__(self, step: int, why: str):
        super().__init__(f"checkpoint of step {step} not saved ({why})")
        self.step = step


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


def save_tensors(path: str, tensors: dict[str, Any]) -> None:
    """safetensors file of the arrays (or :class:`sharded.Lazy`), written one by one and fsynced."""
    sharded.write_safetensors(path, tensors.items())


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
                 barrier: Callable[[], None] = lambda: None, layout: str = "mindtrain", async_save: bool = False,
                 any_failed: Callable[[bool], bool] = lambda failed: failed):
        self.any_failed = any_failed  # True on every rank when any rank's flag is True (a collective)
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

        ``tensors`` maps file name -> {tensor name: array, or a :class:`sharded.Lazy` made
        when its turn to be written comes}; ``json_files`` maps file name ->
        JSON-serialisable object. Ranks must use distinct file names.
        """
        self.wait()
        final = os.path.join(self.save_path, folder_name(step, self.layout))
        tmp = self._tmp(step)
        error: Optional[BaseException] = None
        if self.rank == 0:
            try:
                os.makedirs(self.save_path, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except OSError as err:
                error = err
        self._check(step, error)  # also the barrier: the folder exists for every rank
        if not self.async_save:
            try:
                faults.save_error(step)
                _write_files(tmp, tensors, json_files or {})
            except OSError as err:  # disk full, quota, I/O error: this save is lost, training is not
                error = err
            self._check(step, error)
            self._publish(step)
            return final
        # host copies first (this rank's pieces only): training may overwrite the arrays it handed over
        tensors = {f: {k: np.array(v.get() if isinstance(v, sharded.Lazy) else v, copy=True)
                       for k, v in arrays.items()} for f, arrays in tensors.items()}
        json_files = json.loads(json.dumps(json_files or {}))
        errors: list = []

        def write() -> None:
            try:
                faults.save_error(step)
                _write_files(tmp, tensors, json_files)
            except BaseException as e:  # reported on the training thread by wait()
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
        if errors and not isinstance(errors[0], OSError):
            raise errors[0]
        self._check(step, errors[0] if errors else None)
        self._publish(step)

    def _check(self, step: int, error: Optional[BaseException]) -> None:
        """Every rank learns whether any rank failed to write ``step`` (one collective); if one
        did, the temporary folder goes and :class:`SaveFailed` is raised on every rank."""
        if not self.any_failed(error is not None):
            return
        if self.rank == 0:
            shutil.rmtree(self._tmp(step), ignore_errors=True)
        raise SaveFailed(step, f"{type(error).__name__}: {error}" if error is not None else "on another rank")

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
                     "the mindtrain layout names them model-/opt-{rank}-{world}.safetensors")
    return notes


def _write_files(folder: str, tensors: dict[str, dict[str, np.ndarray]], json_files: dict[str, Any]) -> None:
    for name, arrays in tensors.items():
        save_tensors(os.path.join(folder, name), arrays)
    for name, obj in json_files.items():
        save_json(os.path.join(folder, name), obj)
    faults.slow_save()  # tests only (MINDTRAIN_FAULT=slow_save:S): a window before the rename


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
        complete = [s for s in saved_steps(load_path) if s != step]
        if complete:
            older = [s for s in complete if s < step] or complete
            ours_older, theirs_older = (os.path.join(load_path, folder_name(older[-1], layout)) for layout in LAYOUTS)
            choose = (f"; to resume from the newest complete one before it, set checkpoint.load_path="
                      f"{ours_older if os.path.isdir(ours_older) else theirs_older}")
        else:
            choose = "; no complete checkpoint is left in this folder"
        raise CheckpointError(f"checkpoint.load_path: tracker '{tracker}' names iteration {step}, which is not a "
                              f"complete checkpoint (looked for '{ours}' and '{theirs}'){choose}")
    if os.path.isfile(os.path.join(load_path, STATE_FILE)) and not mf.is_checkpoint_folder(load_path):
        return "checkpoint", load_path
    if mf.is_checkpoint_folder(load_path):
        return "mindformers", load_path
    if os.path.isfile(os.path.join(load_path, "config.json")):
        return "hf", load_path
    raise CheckpointError(f"checkpoint.load_path: '{load_path}' holds no {STATE_FILE}, no {TRACKER}, no MindFormers "
                          f"{mf.COMMON_FILE} with model files and no config.json; point it at a checkpoint folder "
                          "(iter_NNNNNNN or iteration_NNNNNNNN), the save_path holding the tracker, or an HF model directory")


def loads_by_pieces(load_path: str) -> bool:
    """Whether ``checkpoint.load_path`` names weights that each rank reads piece by piece once
    laid out (a sharded checkpoint, an HF directory); a path that names nothing loadable
    says so later, in :meth:`Checkpointer.load_weights`."""
    try:
        kind, folder = resolve_checkpoint(load_path)
    except CheckpointError:
        return False
    return kind in ("hf", "mindformers") or (kind == "checkpoint" and sharded.is_sharded(folder))


def load_tensors(folder: str, name: str) -> dict[str, np.ndarray]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint.load_path: '{path}' is missing; the checkpoint is incomplete or was saved by a different layout")
    try:
        return load_file(path)
    except Exception as err:  # safetensors' own error types: a truncated or corrupted file
        raise damaged(path, err) from None


def damaged(path: str, err: BaseException) -> CheckpointError:
    return CheckpointError(mf.damaged_message(path, err))


def check_floating(weights: dict[str, np.ndarray], source: str) -> None:
    """Every model weight in a checkpoint is floating point (the model's parameters are)."""
    for name, a in weights.items():
        if np.asarray(a).dtype.kind != "f":
            raise CheckpointError(f"checkpoint.load_path: '{name}' in {source} is {np.asarray(a).dtype}, but the "
                                  "model's parameters are floating point; the checkpoint is damaged or of another model")


def load_json(folder: str, name: str = STATE_FILE) -> Any:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint.load_path: '{path}' is missing; the checkpoint is incomplete")
    return mf.read_json(path)


# ---------------------------------------------------------------------------- save / load

def rank_file(rank: int) -> str:
    """This rank's data-loader and RNG state."""
    return f"rank_{rank:05d}.json"


def schedule_state(schedule) -> dict[str, Any]:
    """What trainer_state.json records of the learning-rate schedule."""
    return {"kind": schedule.kind, "peak": schedule.peak, "total": schedule.total, "warmup": schedule.warmup}


@dataclass
class Resume:
    """A checkpoint whose training state (optimizer, data position, RNG, counters) is to be
    restored after its weights were loaded: its folder, its trainer_state.json (for a
    checkpoint MindFormers wrote: the counters of its common.json) and the reader of its
    moments (a sharded checkpoint's: :class:`sharded.ShardedReader` or
    :class:`mf.MindFormersBoxes`; None for the earlier full-tensor folders)."""

    folder: str
    state: Optional[dict]
    reader: Any = None


class Checkpointer:
    """Loads and saves this rank's training state (``out``: rank 0's start-up lines)."""

    def __init__(self, cfg, rank: int, world_size: int, dp: int, barrier: Callable[[], None] = lambda: None,
                 out: Callable[[str], None] = print, any_failed: Callable[[bool], bool] = lambda failed: failed):
        self.cfg = cfg
        self.ck = cfg.checkpoint
        self.rank = rank
        self.world_size = world_size
        self.dp = dp
        self.out = out
        self.writer: Optional[CheckpointWriter] = None
        self.all_gather_bytes: Callable[[bytes], list[bytes]] = lambda data: [data]
        """Every rank's bytes in rank order (a collective); the trainer sets the runtime's."""
        self._pending: Optional[sharded.ShardedReader] = None  # weights to load once laid out
        if self.ck.enable_save:
            self.writer = CheckpointWriter(self.ck.save_path or os.path.join("output", "checkpoint"), self.ck.save_max,
                                           rank=rank, world_size=world_size, barrier=barrier, layout=self.ck.layout,
                                           async_save=self.ck.async_save, any_failed=any_failed)
            for note in save_notes(self.ck):
                out(f"mindtrain: {note}")

    def check_storage(self, param_bytes: int) -> None:
        """Before step 1: ``save_path`` can be created and written, and (rank 0, for the folder
        all ranks write into) has room for one checkpoint: the weights, plus AdamW's two moments
        unless ``no_save_optim``, at float32 and full shape; also within the process's
        file-size limit (the whole model's, as one process writes it)."""
        if self.writer is None:
            return
        path = self.writer.save_path
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".write_test_{self.rank}")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as err:
            raise CheckpointError(f"checkpoint.save_path: '{path}' cannot be written ({err.strerror or err}); "
                                  "choose a writable folder or set checkpoint.enable_save: false") from None
        if self.rank != 0:
            return
        model_file = int(param_bytes)
        need = model_file * (1 if self.ck.no_save_optim else 3) + (1 << 20)
        free = shutil.disk_usage(path).free
        if need > free:
            raise CheckpointError(f"checkpoint.save_path: '{path}' has {free / 2**30:.2f} GiB free, but one checkpoint "
                                  f"needs about {need / 2**30:.2f} GiB (weights and AdamW moments, float32); free "
                                  "space or choose another folder")
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and model_file > limit:
            raise CheckpointError(f"checkpoint.save_path: the model file needs about {model_file / 2**20:.1f} MiB, but this "
                                  f"process may write files of at most {limit / 2**20:.1f} MiB (ulimit -f); raise the "
                                  "limit or set checkpoint.enable_save: false")

    # ------------------------------------------------------------------ load
    def load_weights(self, model) -> Optional[Resume]:
        """Model weights from ``checkpoint.load_path`` (a checkpoint or an HF directory) into
        the whole model; returns what :meth:`load_state` restores once the layout exists."""
        from mindtrain.models import load_hf_state_dict

        kind, folder = resolve_checkpoint(self.ck.load_path)
        if kind == "hf":  # read piece by piece once laid out
            from mindtrain.models.hf_checkpoint import HFBoxes

            from mindtrain.models.lora import is_adapter

            # LoRA's adapters are not HF weights: they start from their initial values
            shapes = {p.name: tuple(p.shape) for p in model.get_parameters() if not is_adapter(p.name)}
            try:
                reader = HFBoxes(folder, self.cfg.model, shapes)
                reader.check_shapes(shapes.items())
                reader.check_files()
            except UserError:
                raise
            except Exception as err:  # a truncated or corrupted safetensors file
                raise damaged(folder, err) from None
            self._pending = reader
            self.out(f"mindtrain: started from the weights of HF model directory {folder}")
            return None
        state = load_json(folder) if os.path.isfile(os.path.join(folder, STATE_FILE)) else None
        reader = None
        if kind == "mindformers":  # read piece by piece once the layout exists
            reader = mf.MindFormersBoxes(folder, self.cfg.model, {p.name: tuple(p.shape) for p in model.get_parameters()})
            reader.check_shapes((p.name, tuple(p.shape)) for p in model.get_parameters())
            reader.check_files()
            if reader.missing:
                from mindtrain.models.lora import is_adapter

                fresh = sum(1 for n in reader.missing if is_adapter(n))
                what = ", ".join(x for x in (f"{len(reader.missing) - fresh} MTP parameters" if fresh < len(reader.missing)
                                             else "", f"{fresh} LoRA adapters" if fresh else "") if x)
                self.out(f"mindtrain: {folder} holds no weights for the {what}; they start from their initial values")
            if state is None:  # written by MindFormers: its counters are in common.json
                state = mf.state_from_common(mf.read_json(os.path.join(folder, mf.COMMON_FILE)),
                                             self.cfg.training.global_batch_size)
                has_optimizer = reader.has_optimizer()
            else:
                has_optimizer = not state.get("weights_only", False)
            if has_optimizer and not self.ck.no_load_optim:
                from mindtrain.models.lora import is_adapter

                trained = [p.name for p in model.trainable_params()]
                if any(is_adapter(n) for n in trained):  # LoRA: the optimizer holds the adapters only
                    trained = [n for n in trained if is_adapter(n)]
                reader.check_moments(trained)
        elif sharded.is_sharded(folder):  # read piece by piece once the layout exists
            reader = sharded.ShardedReader(folder)
            reader.check_shapes((p.name, tuple(p.shape)) for p in model.get_parameters())
            reader.check_files()  # damaged files are one line now, before the layout is built
            has_optimizer = not (state or {}).get("weights_only", False)
        else:
            weights = load_tensors(folder, MODEL_FILE)
            if state is not None and "weights_only" in state:
                has_optimizer = not state["weights_only"]  # a missing optimizer file is then an error below
            else:
                has_optimizer = os.path.isfile(os.path.join(folder, OPTIMIZER_FILE))
        self._check_model_config(folder)
        if reader is None:
            check_floating(weights, folder)
            load_hf_state_dict(model, weights, source=folder, in_place=False)  # not run yet; laid out next
        else:
            self._pending = reader
        if self.ck.no_load_optim:
            self.out(f"mindtrain: loaded model weights from {folder} (checkpoint.no_load_optim is true)")
            return None
        if not has_optimizer:
            self.out(f"mindtrain: {folder} holds model weights only (saved with checkpoint.no_save_optim); "
                     "training starts from them at step 0 with fresh optimizer state")
            return None
        return Resume(folder, state, reader)

    def fill_buffers(self, buffers: Sequence[tuple[str, Any]], seed: int) -> None:
        """First values of a model built empty, part 1 (before it is laid out): the untrained
        ``buffers`` (``(name, Parameter)``, e.g. expert biases), whole on every rank, from the
        sharded checkpoint :meth:`load_weights` found, else their initial values."""
        from mindspore import Tensor

        from mindtrain.models import init_of, initial_values, is_empty

        reader = self._pending  # its shapes were checked against the whole model by load_weights
        stored = set(reader.names()) if reader is not None else set()
        for name, p in buffers:
            if not is_empty(p):
                continue
            value = reader.read_full(name) if name in stored else initial_values(name, init_of(p), p.shape, seed=seed)
            p.set_data(Tensor(np.ascontiguousarray(value, np.float32)))

    def fill_layout(self, layout, params: dict[str, Any], seed: int) -> None:
        """First values of a model built empty, part 2: each of ``layout``'s pieces, read from
        the sharded checkpoint :meth:`load_weights` found (only the parts of its files that
        overlap the piece), else made from the model's initial values (``params``: the
        model's Parameters by name, which know how they start). Nothing else is made."""
        from mindtrain.models import init_of, initial_values

        reader, self._pending = self._pending, None
        shards = layout.shards()
        tensors = [t for _, t in layout.named_params]
        stored = set(reader.names()) if reader is not None else set()

        def made(sh):  # a weight the checkpoint lacks (an HF directory's MTP) starts as the model does
            return initial_values(sh.name, init_of(params[sh.name]), sh.global_shape, sh.offset, sh.shape, seed)

        # one piece at a time, as the layout takes them
        layout.load_params(read_pieces(reader if stored else None, shards, tensors, made, stored))

    def load_state(self, resume: Resume, layout, optimizer, loader, schedule, total_steps: int) -> dict[str, int]:
        """Optimizer moments (this rank's pieces of them, laid out as ``layout``'s
        parameters), data position and RNG state; returns the counters (step,
        consumed_samples, skipped_total, skipped_in_row).

        What trainer_state.json holds is checked against this run:

        - ``seed``: a different ``training.seed`` is an error (the data order and the saved
          RNG state follow the seed; a changed one would re-read some samples and skip
          others), as the data loader already refuses another shuffle seed;
        - ``lr_schedule``: a different schedule (e.g. ``training.steps`` raised to train
          further, which lengthens the decay) is a one-line warning and the config's
          schedule applies from the resumed step on (Megatron's
          ``--override-opt_param-scheduler``; torchtitan rebuilds its scheduler from the
          config as well);
        - ``world_size``/``dp``: the per-rank loader and RNG files are read only by the
          layout that wrote them; any other restarts the data stream at
          ``consumed_samples`` (a one-line note), as the weights and moments are saved
          at full shape and fit any layout;
        - ``weights_only``: decides whether optimizer state is read (in :meth:`load_weights`);
        - ``config.json``: a model configuration other than the checkpoint's is a warning
          naming the fields (mis-shaped weights already fail to load).
        """
        folder = resume.folder
        named_params = layout.named_params
        names = [n for n, _ in named_params]
        if resume.reader is not None:
            shards = layout.shards()
            state = resume.state if resume.state is not None else load_json(folder)
            self.check_resume(state, schedule, folder)
            # MindFormers' optimizer step, else its common.json's (the step the counters say)
            local = {"step": resume.reader.read_full("step") if "step" in resume.reader.names()
                     else np.array(state["step"], np.int64)}
            for kind, idx, _ in optimizer.moment_sets():  # AdamW's moments, Muon's momentum buffers
                moment = [sharded_replace(shards[i], f"{kind}.{shards[i].name}") for i in idx]
                for sh, a in zip(moment, read_pieces(resume.reader, moment, [named_params[i][1] for i in idx])):
                    local[sh.name] = a
            optimizer.load_state_dict(local)
            return self._restore_position(state, folder, loader, total_steps)
        state = resume.state if resume.state is not None else load_json(folder)
        saved = load_tensors(folder, OPTIMIZER_FILE)
        self.check_resume(state, schedule, folder)
        local = {"step": saved["step"]} if "step" in saved else {}
        for kind in ("exp_avg", "exp_avg_sq"):
            full = {n: saved[f"{kind}.{n}"] for n in names if f"{kind}.{n}" in saved}
            if len(full) == len(names):
                for n, t in zip(names, layout.to_local(full)):
                    local[f"{kind}.{n}"] = t.asnumpy()
        optimizer.load_state_dict(local)
        return self._restore_position(state, folder, loader, total_steps)

    def _restore_position(self, state: dict, folder: str, loader, total_steps: int) -> dict[str, int]:
        """The counters, data position and RNG state of a resumed checkpoint."""
        counters = {"step": int(state["step"]), "consumed_samples": int(state["consumed_samples"]),
                    "skipped_total": int(state["skipped_total"]), "skipped_in_row": int(state["skipped_in_row"])}
        if counters["step"] >= total_steps:
            raise UserError(f"checkpoint.load_path: the checkpoint is at step {counters['step']}, but training.steps "
                            f"is {total_steps}; raise training.steps to train further")
        path = os.path.join(folder, rank_file(self.rank))
        same_layout = state.get("dp") == self.dp and state.get("world_size", self.world_size) == self.world_size
        if same_layout and os.path.isfile(path):
            rank_state = load_json(folder, rank_file(self.rank))
            loader.load_state_dict(rank_state["loader"])
            _set_numpy_rng_state(rank_state["rng"]["numpy"])
            random.setstate(_python_rng_from_json(rank_state["rng"]["python"]))
        else:
            if "dp" in state and not same_layout:
                self.out(f"mindtrain: {folder} was saved by {state.get('world_size', '?')} workers with "
                         f"data_parallel {state['dp']}, this run has {self.world_size} with {self.dp}: the data "
                         f"stream continues at sample {counters['consumed_samples']} with fresh per-rank RNG state")
            loader.load_state_dict({"consumed_samples": counters["consumed_samples"]})
        self.out(f"mindtrain: resumed from {folder} at step {counters['step']}")
        return counters

    def check_resume(self, state: dict, schedule, folder: str) -> None:
        """The seed and learning-rate schedule of trainer_state.json against this run (see :meth:`load_state`)."""
        seed = self.cfg.training.seed
        if "seed" in state and int(state["seed"]) != seed:
            raise CheckpointError(f"training.seed: {seed} differs from the checkpoint's {state['seed']} ({folder}); "
                                  f"resume with training.seed: {state['seed']}, or set checkpoint.no_load_optim "
                                  "to start a new run from its weights")
        saved = state.get("lr_schedule")
        now = schedule_state(schedule)
        if saved is not None and saved != now:
            diff = ", ".join(f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k])
            self.out(f"mindtrain: warning: the learning-rate schedule differs from the checkpoint's ({diff}); "
                     "the config's schedule applies from the resumed step on")

    def _check_model_config(self, folder: str) -> None:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            return
        from mindtrain.models import config_to_hf

        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        now = json.loads(json.dumps(config_to_hf(self.cfg.model)))
        keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if keys:
            shown = ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys[:3])
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            self.out(f"mindtrain: warning: model settings differ from the checkpoint's config.json ({shown}{more})")

    # ------------------------------------------------------------------ save
    def _common_files(self, step: int, counters: dict[str, int], schedule, with_state: bool,
                      loader_state: dict) -> dict[str, object]:
        """The JSON files of a checkpoint folder: this rank's data and RNG state, and (rank 0)
        config.json and trainer_state.json."""
        files: dict[str, object] = {}
        if with_state:
            files[rank_file(self.rank)] = {"loader": loader_state,
                                           "rng": {"numpy": _numpy_rng_state(), "python": _python_rng_state()}}
        if self.rank == 0:
            from mindtrain.models import config_to_hf

            files["config.json"] = config_to_hf(self.cfg.model)
            files[STATE_FILE] = dict(counters, world_size=self.world_size, dp=self.dp,
                                     lr_schedule=schedule_state(schedule), seed=self.cfg.training.seed,
                                     weights_only=not with_state)
        return files

    def save_sharded(self, step: int, counters: dict[str, int], schedule, layout, buffers: Sequence[tuple[str, Any]],
                     optimizer, loader_state: dict, total_steps: int) -> str:
        """Write ``step``'s folder in ``checkpoint.layout`` (call on every rank): each rank the
        pieces of ``layout``'s parameters (and, unless ``checkpoint.no_save_optim``, of
        ``optimizer``'s moments) it is the first holder of, plus the untrained ``buffers``
        once; rank 0 also metadata.json (and MindFormers' common.json). Nothing is gathered:
        the ranks exchange only the list of their pieces, and each piece is made from the
        rank's own tensors when its turn to be written comes."""
        import zlib

        pieces = self.local_pieces(layout, buffers, optimizer)
        message = zlib.compress(json.dumps([p.to_json() for p, _ in pieces]).encode())
        everyone = [[sharded.Piece.from_json(j) for j in json.loads(zlib.decompress(b))]
                    for b in self.all_gather_bytes(message)]
        mindformers = self.ck.layout == "mindformers"
        plan = sharded.plan_files(everyone, self.ck.prefix if mindformers else None)
        tensors_by_file: dict[str, dict[str, sharded.Lazy]] = {}
        for p, lazy in pieces:
            if plan.writer[p.key] == self.rank:
                tensors_by_file.setdefault(plan.file[p.key], {})[p.name] = lazy
        files = self._common_files(step, counters, schedule, optimizer is not None, loader_state)
        if self.rank == 0:
            files[sharded.METADATA_FILE] = plan.metadata(everyone)
            if mindformers:
                files[mf.COMMON_FILE] = mf.common_info(step, total_steps, self.cfg.training.global_batch_size,
                                                       counters["consumed_samples"])
        return self.writer.save(step, tensors_by_file, files)

    def local_pieces(self, layout, buffers: Sequence[tuple[str, Any]], optimizer
                     ) -> list[tuple[sharded.Piece, sharded.Lazy]]:
        """This rank's pieces of a save, each made when written: its boxes of ``layout``'s
        parameters, the ``buffers`` whole, and (``optimizer`` not None) the boxes of AdamW's
        moments and its step; in the mindformers layout as boxes of MindFormers' tensors."""
        shards = layout.shards()
        tensors = [t for _, t in layout.named_params]
        pieces = pieces_of(shards, tensors)
        for name, p in buffers:  # whole on every rank
            shape = tuple(p.shape)
            pieces.append((sharded.Piece("model", name, shape, (0,) * len(shape), shape, "float32"),
                           sharded.Lazy(name, shape, np.dtype(np.float32), p.asnumpy)))
        if optimizer is not None:
            for kind, idx, tensors in optimizer.moment_sets():  # AdamW's moments, Muon's momentum buffers
                pieces += pieces_of([shards[i] for i in idx], tensors, "opt", f"{kind}.")
            step_count = np.array(optimizer.step_count, np.int64)
            pieces.append((sharded.Piece("opt", "step", (), (), (), "int64"),
                           sharded.Lazy("step", (), step_count.dtype, lambda: step_count)))
        if self.ck.layout == "mindformers":
            pieces = mf.to_pieces(pieces, self.cfg.model)
        return pieces

    def wait(self) -> None:
        """An asynchronous save finishes (call before training returns)."""
        if self.writer is not None:
            self.writer.wait()


def sharded_replace(shard, name: str):
    """The same box of another tensor (an optimizer moment of the parameter)."""
    import dataclasses

    return dataclasses.replace(shard, name=name)


def read_pieces(reader, shards: Sequence[Any], tensors: Sequence[Any],
                made: Optional[Callable[[Any], np.ndarray]] = None, stored: Optional[set] = None
                ) -> Iterator[np.ndarray]:
    """Each shard's box (one at a time, as they are taken) read from ``reader`` (a sharded
    checkpoint or HF directory) or, for names not ``stored`` there, ``made``; laid out as the
    local tensor it belongs to (FSDP's padding rows zero)."""
    for sh, t in zip(shards, tensors):
        local_shape = tuple(t.shape)
        if sh.numel == 0:
            yield np.zeros(local_shape, np.float32)
            continue
        if reader is not None and (stored is None or sh.name in stored):
            piece = reader.read(sh.name, sh.offset, sh.shape)
        else:
            piece = made(sh)
        yield sh.place(np.asarray(piece, np.float32), local_shape)


def pieces_of(shards: Sequence[Any], tensors: Sequence[Any], kind: str = "model",
              prefix: str = "") -> list[tuple[sharded.Piece, sharded.Lazy]]:
    """``(Piece, Lazy)`` of each non-empty shard: the box's values, taken from its tensor when
    the lazy is made."""
    out = []
    for sh, t in zip(shards, tensors):
        if sh.numel == 0 and sh.shape:
            continue
        dtype = np.dtype(str(t.dtype).lower())  # Float32 -> float32
        out.append((sharded.Piece(kind, prefix + sh.name, sh.global_shape, sh.offset, sh.shape, dtype.name),
                    sharded.Lazy(prefix + sh.name, sh.shape, dtype, lambda sh=sh, t=t: sh.take(t.asnumpy()))))
    return out


def _numpy_rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}


def _set_numpy_rng_state(s: dict) -> None:
    np.random.set_state((s["kind"], np.array(s["keys"], np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"]))


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _python_rng_from_json(s: list) -> tuple:
    return (s[0], tuple(s[1]), s[2])
