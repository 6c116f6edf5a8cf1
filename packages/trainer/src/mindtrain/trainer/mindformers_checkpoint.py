"""MindFormers' PyNative checkpoint layout (``mindformers/checkpoint/``), written and read
piece by piece.

Layout under ``save_path``::

    latest_checkpointed_iteration.txt          the newest complete iteration, e.g. ``5``
    iteration_00000005/
        {prefix}-model-{rank:07d}-{world:07d}.safetensors   this rank's boxes of the parameters,
                                                            MindFormers' PyNative names
        {prefix}-opt-{rank:07d}-{world:07d}.safetensors     adam_m.<name>, adam_v.<name>, global_step
        common.json        CommonInfo: epoch_num, step_num, global_step, loss_scale,
                           global_batch_size, consumed_samples, ckpt_status
        metadata.json      per tensor: global shape and the chunks (global_offset,
                           local_shape) each file holds ("state_dict_metadata"), and which
                           file stores each chunk ("storage_data")

Every rank writes the boxes of MindFormers' tensors that its pieces of mindtrain's tensors
make (:func:`to_pieces`, through :mod:`mindtrain.trainer.mindformers_names`): a renamed
tensor's piece is a box as it is, the gate and up pieces of the same rows one box of
``linear_fc1`` together, a piece of ``q_a_proj`` a box of ``linear_qkv`` of its own, a piece of
Qwen3's q/k/v a box of ``linear_qkv`` per query-group block it crosses (a rank's whole groups
joined into one), a piece of DeepSeek-V4's hyper-connection ``scale`` a box of each of the
alphas it covers (the hash table int32). Nothing is gathered. A file holds one box per tensor, so a rank with two
boxes of one tensor (``linear_qkv``'s FSDP-cut parts) writes a second file (MindFormers names files by index
and count, ``{prefix}-model-{j * world + rank}-{n * world}``, as its balanced save does).
:class:`MindFormersBoxes` reads it back, and what MindFormers wrote, box by box
under mindtrain's names (:class:`mindtrain.trainer.sharded.ShardedReader` reads the files). A
checkpoint without ``metadata.json`` holds whole tensors (MindFormers writes none for one
card). numpy, safetensors and json only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np

from mindtrain.config import UserError
from mindtrain.trainer import mindformers_names as names
from mindtrain.trainer import sharded
from mindtrain.trainer.mindformers_name_table import INTEGER_TENSORS
from mindtrain.trainer.mindformers_names import Placement
from mindtrain.trainer.sharded import Lazy, Piece

TRACKER = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
METADATA_FILE = sharded.METADATA_FILE
FOLDER = re.compile(r"^iteration_(\d{8,})$")
_FILE = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<rank>\d{7})-(?P<world>\d{7})\.safetensors$")
# MindFormers' AdamW names its moments after the model parameter: adam_m.<name>, adam_v.<name>
MOMENTS = {"adam_m": "exp_avg", "adam_v": "exp_avg_sq", "muon_m": "muon_m"}
# MindFormers' Muon keeps muon_m.<name> (its momentum buffer) for the parameters it updates
# and adam_m / adam_v for the others; AdamW keeps adam_m / adam_v for every parameter
ADAM_MOMENTS = ("adam_m", "adam_v")
STEP = "global_step"  # MindFormers' optimizer step, shape [1]
file_name = sharded.file_name
damaged_message = sharded.damaged_message


def folder_name(step: int) -> str:
    return f"iteration_{step:08d}"


def is_checkpoint_folder(folder: str) -> bool:
    """A MindFormers iteration folder: common.json plus at least one model file."""
    if not os.path.isfile(os.path.join(folder, COMMON_FILE)):
        return False
    return any((m := _FILE.match(f)) and m.group("kind") == "model" for f in os.listdir(folder))


def common_info(step: int, total_steps: int, global_batch_size: int, consumed_samples: int) -> dict[str, Any]:
    """common.json as MindFormers' CheckpointCallback fills CommonInfo (step_num is max_steps)."""
    return {"epoch_num": 1, "step_num": total_steps, "global_step": step, "loss_scale": 1.0,
            "global_batch_size": global_batch_size, "consumed_samples": consumed_samples, "ckpt_status": None}


def state_from_common(common: dict[str, Any], global_batch_size: int) -> dict[str, int]:
    """The trainer's counters from common.json (a checkpoint MindFormers wrote has no
    trainer_state.json). The data position is consumed_samples, or global_step x
    global_batch_size when the checkpoint predates that field (as MindFormers)."""
    step = int(common["global_step"])
    consumed = common.get("consumed_samples")
    if consumed is None:
        consumed = step * int(common.get("global_batch_size") or global_batch_size)
    return {"step": step, "consumed_samples": int(consumed), "skipped_total": 0, "skipped_in_row": 0}


def read_json(path: str) -> Any:
    """A checkpoint's JSON file; unreadable JSON is the damaged-file line."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(damaged_message(path, err)) from None


# ---------------------------------------------------------------------------- writing

def _moment(name: str) -> tuple[str, str]:
    """(MindFormers' prefix, parameter name) of an optimizer tensor name (``exp_avg.<n>``)."""
    for theirs, ours in MOMENTS.items():
        if name.startswith(ours + "."):
            return theirs + ".", name[len(ours) + 1:]
    raise ValueError(f"{name}: not an AdamW moment")


def to_pieces(pieces: Sequence[tuple[Piece, Lazy]], cfg: Any = None) -> list[tuple[Piece, Lazy]]:
    """This rank's pieces of mindtrain's tensors (weights and buffers of kind "model"; the
    moments ``exp_avg.<n>`` / ``exp_avg_sq.<n>`` and ``step`` of kind "opt") as pieces of
    MindFormers' tensors, each made when it is written. With the model config ``cfg`` they take
    MindFormers' PyNative names, layouts and types, a piece of a tensor MindFormers keeps as
    several (V4's hyper-connection ``scale``) cut into a piece of each, plus MindFormers'
    constants that mindtrain has none of (``tokens_per_expert`` zeros, V4's ``rms_weight`` /
    ``q_rms_gamma`` ones: :func:`mindformers_names.companion_boxes`); without, the network's
    own names. Parts of one MindFormers tensor that together make one box (the gate and up
    pieces of the same rows, adjacent halves) become one piece; the others stay several boxes
    of it."""
    regions: dict[tuple[str, str], list[tuple[Placement, Piece, Lazy]]] = {}
    out: list[tuple[Piece, Lazy]] = []
    for p, lazy in pieces:
        if p.kind == "opt" and p.name == "step":
            out.append((Piece("opt", STEP, (1,), (0,), (1,), "int64"),
                        Lazy(STEP, (1,), np.dtype(np.int64), lambda g=lazy.get: np.asarray(g(), np.int64).reshape(1))))
            continue
        prefix, name = _moment(p.name) if p.kind == "opt" else ("", p.name)
        pls = (names.placements(name, p.global_shape, cfg) if cfg is not None
               else [Placement(name, p.global_shape, tuple(range(len(p.global_shape))))])
        cut = [(pl, box) for pl in pls for box in (pl.clip(p.offset, p.shape),) if box is not None]
        whole = len(cut) == 1 and cut[0][1] == (tuple(p.offset), tuple(p.shape))
        get = lazy.get if whole else _shared(lazy.get, len(cut))
        for pl, (offset, shape) in cut:
            pl = pl.moment(prefix) if prefix else pl
            part, part_lazy = p, lazy
            if not whole:  # the part of the piece in this MindFormers tensor
                part = Piece(p.kind, p.name, p.global_shape, offset, shape, p.dtype)
                cut_box = tuple(slice(o - b, o - b + n) for o, b, n in zip(offset, p.offset, shape))
                part_lazy = Lazy(lazy.name, shape, lazy.dtype, lambda g=get, c=cut_box: g()[c])
            regions.setdefault((p.kind, pl.theirs), []).append((pl, part, part_lazy))
            if cfg is None or p.kind != "model":
                continue
            box_offset, extent = pl.box(offset, shape)
            for theirs, c_offset, c_shape, axes, value in names.companion_boxes(pl.theirs, box_offset, extent, cfg):
                out.append((Piece("model", theirs, tuple(pl.shape[a] for a in axes), c_offset, c_shape, "float32"),
                            Lazy(theirs, c_shape, np.dtype(np.float32),
                                 lambda s=c_shape, v=value: np.full(s, v, np.float32))))
    for (kind, theirs), parts in regions.items():
        for offset, shape, get in _boxes(parts):
            pl, p, lazy = parts[0]
            dtype = np.dtype(pl.dtype) if pl.dtype is not None else lazy.dtype
            out.append((Piece(kind, theirs, pl.shape, offset, shape, pl.dtype or p.dtype),
                        Lazy(theirs, shape, dtype, get)))
    return out


def _boxes(parts: list[tuple[Placement, Piece, Lazy]]) -> list[tuple[tuple, tuple, Callable[[], np.ndarray]]]:
    """(offset, shape, make) of the boxes of one MindFormers tensor that a rank's pieces of its
    parts make: every-other-row parts paired with their partner, a part in blocks (Qwen3's
    q/k/v in ``linear_qkv``) cut into a box per block it crosses, then boxes adjacent along the
    parts' axis joined (a rank's whole query groups: one box)."""
    dim = parts[0][0].dim
    boxes: list[tuple[tuple, tuple, Callable[[], np.ndarray]]] = []
    interleaved: dict[tuple, dict[int, tuple]] = {}
    for pl, p, lazy in parts:
        if pl.block != 1:
            runs = pl.runs(p.offset, p.shape)
            whole = _shared(lambda pl=pl, g=lazy.get: pl.to_theirs(np.asarray(g())), len(runs))
            for offset, shape in runs:
                cut = tuple(slice(o - b, o - b + n) for o, b, n in zip(offset, p.offset, shape))
                box_offset, extent = pl.box(offset, shape)
                boxes.append((box_offset, extent, lambda w=whole, cut=tuple(cut[a] for a in pl.perm): w()[cut]))
            continue
        offset, extent = pl.box(p.offset, p.shape)
        make = (lambda pl=pl, g=lazy.get: pl.to_theirs(np.asarray(g())))
        if pl.stride == 1:
            boxes.append((offset, extent, make))
            continue
        base = offset[:dim] + (offset[dim] - pl.start,) + offset[dim + 1:]
        interleaved.setdefault((base, extent), {})[pl.start] = make
    for (base, extent), makers in interleaved.items():
        assert sorted(makers) == [0, 1], f"{parts[0][0].theirs}: a rank holds a gate piece without its up piece"
        n = (extent[dim] + 1) // 2 * 2
        shape = extent[:dim] + (n,) + extent[dim + 1:]

        def make(makers=makers, shape=shape):
            a, b = makers[0](), makers[1]()
            out = np.empty(shape, a.dtype)
            out[(slice(None),) * dim + (slice(0, None, 2),)] = a
            out[(slice(None),) * dim + (slice(1, None, 2),)] = b
            return out

        boxes.append((base, shape, make))
    boxes.sort(key=lambda b: (b[0][:dim] + b[0][dim + 1:], b[0][dim]))
    joined: list[tuple[tuple, tuple, Callable[[], np.ndarray]]] = []
    for offset, shape, make in boxes:
        if joined:
            o, s, m = joined[-1]
            same = o[:dim] + o[dim + 1:] == offset[:dim] + offset[dim + 1:] and s[:dim] + s[dim + 1:] == \
                shape[:dim] + shape[dim + 1:]
            if same and o[dim] + s[dim] == offset[dim]:
                joined[-1] = (o, s[:dim] + (s[dim] + shape[dim],) + s[dim + 1:],
                              lambda m=m, make=make: np.concatenate([m(), make()], axis=dim))
                continue
        joined.append((offset, shape, make))
    return joined


def _shared(make: Callable[[], np.ndarray], uses: int) -> Callable[[], np.ndarray]:
    """``make`` called once for ``uses`` calls: the array is kept until the last of them (a
    piece cut into several boxes is fetched once, and not held after its boxes are written)."""
    held: dict[str, Any] = {"left": uses}

    def get() -> np.ndarray:
        if "a" not in held:
            held["a"] = make()
        a = held["a"]
        held["left"] -= 1
        if held["left"] <= 0:
            del held["a"]
        return a

    return get


def checkpoint_files(weights: dict[str, np.ndarray], optimizer_state: Optional[dict[str, np.ndarray]],
                     prefix: Optional[str], world: int, common: dict[str, Any], model_config: Any = None
                     ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """The files of a checkpoint whose one writing rank holds every tensor whole (full-shape
    ``weights`` and AdamW's ``optimizer_state`` as ``AdamW.state_dict`` keys it): the model
    and optimizer files of rank 0 of ``world``, common.json and metadata.json; as
    :func:`to_pieces` names them. For tools and tests; the trainer writes each rank's pieces."""
    def whole(kind: str, name: str, a: np.ndarray) -> tuple[Piece, Lazy]:
        a = np.asarray(a)
        return (Piece(kind, name, a.shape, (0,) * a.ndim, a.shape, a.dtype.name),
                Lazy(name, a.shape, a.dtype, lambda a=a: a))

    pieces = [whole("model", n, a) for n, a in weights.items()]
    pieces += [whole("opt", n, a) for n, a in (optimizer_state or {}).items()]
    mine = to_pieces(pieces, model_config)
    everyone = [[p for p, _ in mine]] + [[] for _ in range(world - 1)]
    plan = sharded.plan_files(everyone, prefix)
    tensors: dict[str, dict[str, np.ndarray]] = {}
    for p, lazy in mine:
        tensors.setdefault(plan.file[p.key], {})[p.name] = lazy.get()
    return tensors, {COMMON_FILE: common, METADATA_FILE: plan.metadata(everyone)}


# ---------------------------------------------------------------------------- reading

def model_files(folder: str) -> list[str]:
    """The folder's checkpoint files (model and optimizer), as MindFormers names them."""
    return sorted(f for f in os.listdir(folder) if _FILE.match(f))


def reader(folder: str) -> sharded.ShardedReader:
    """The folder's tensors under the names its files use, whole or from metadata.json's chunks."""
    return sharded.ShardedReader(folder, whole_files=model_files(folder))


def read_checkpoint(folder: str, workers: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(model tensors, optimizer tensors, common.json) of a MindFormers iteration folder, every
    tensor whole under the names its files use (``workers`` threads read them): for tools and
    tests, not for training, which reads its boxes only (:class:`MindFormersBoxes`)."""
    common = read_json(os.path.join(folder, COMMON_FILE))
    r = reader(folder)
    r.check_files(integers=(STEP,) + tuple(n for n in r.names() if n.endswith(INTEGER_TENSORS)))
    kind = {f: _FILE.match(f).group("kind") for f in model_files(folder)}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        arrays = dict(zip(r.names(), pool.map(r.read_full, r.names())))
    out: dict[str, dict[str, np.ndarray]] = {"model": {}, "opt": {}}
    for name, a in arrays.items():
        out[kind.get(r.chunks[name][0].file, "model")][name] = a
    return out["model"], out["opt"], common


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


_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.")


def with_stored_mtp(cfg: Any, folder: str) -> Any:
    """The model config ``cfg`` with the MTP depth of the MindFormers-named folder (DeepSeek-V4's
    HF config.json reads back without MTP modules: HF builds none)."""
    depth = {int(m.group(1)) + 1 for n in reader(folder).names() for m in (_MTP_NAME.match(n),) if m}
    if not depth or max(depth) <= cfg.num_nextn_predict_layers:
        return cfg
    return dataclasses.replace(cfg, num_nextn_predict_layers=max(depth))


class MindFormersBoxes:
    """A MindFormers-layout folder (MindFormers' or mindtrain's) read box by box under
    mindtrain's names: each parameter ``n`` as the model holds it, its moments
    ``exp_avg.<n>`` / ``exp_avg_sq.<n>`` and ``step``. A box of a parameter is read from the
    parts of the files that hold its box of MindFormers' tensor (every other row of
    ``linear_fc1``'s box, a half of ``weight1``'s, transposed). ``names()``,
    ``global_shapes``, ``read``, ``read_full``, ``check_shapes`` and ``check_files`` as the
    sharded reader has them. ``param_shapes``: the model's parameters (their full shapes), by
    default those the folder's tensors make. MTP weights the folder lacks are left to their
    initial values."""

    def __init__(self, folder: str, cfg: Any, param_shapes: Optional[dict[str, Sequence[int]]] = None):
        self.folder = folder
        self.cfg = cfg
        self.reader = reader(folder)
        stored = self.reader.global_shapes
        self.mindformers_names = names.uses_mindformers_names(stored)
        if param_shapes is None:
            param_shapes = {}
            for theirs, shape in stored.items():
                if theirs == STEP or theirs.startswith(tuple(f"{t}." for t in MOMENTS)):
                    continue
                made = names.parts(theirs, shape, cfg) if self.mindformers_names else [(theirs, shape, None)]
                param_shapes.update({ours: mine for ours, mine, _ in made})
        self.expected = {n: self._place(n, s) for n, s in param_shapes.items()}
        self.global_shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, list[Placement]] = {}
        for name, pls in self.expected.items():
            for theirs, ours in (("", ""), *((f"{t}.", f"{o}.") for t, o in MOMENTS.items())):
                if all(theirs + pl.theirs in stored for pl in pls):
                    self._where[ours + name] = [pl.moment(theirs) if theirs else pl for pl in pls]
                    self.global_shapes[ours + name] = tuple(int(x) for x in param_shapes[name])
        if STEP in stored:
            self.global_shapes["step"] = ()
        mtp = tuple(f"model.layers.{cfg.num_hidden_layers + k}." for k in range(cfg.num_nextn_predict_layers))
        self.missing = [n for n in param_shapes if n not in self._where]
        # LoRA's adapters start from their initial values when the folder holds none (a base model)
        fresh = () if any(n.endswith(names.ADAPTERS) for n in self._where) else names.ADAPTERS
        if any(not (mtp and n.startswith(mtp)) and not n.endswith(fresh) for n in self.missing):
            first = next(n for n in self.missing if not (mtp and n.startswith(mtp)) and not n.endswith(fresh))
            lacking = next(pl.theirs for pl in self.expected[first] if pl.theirs not in stored)
            raise UserError(f"checkpoint.load_path: {folder} holds no '{lacking}' (the model's "
                            f"'{first}'); the checkpoint is of another model")

    def _place(self, name: str, shape: Sequence[int]) -> list[Placement]:
        if self.mindformers_names:
            return names.placements(name, shape, self.cfg)
        return [Placement(name, tuple(int(x) for x in shape), tuple(range(len(shape))))]

    def names(self) -> list[str]:
        return list(self.global_shapes)

    def has_optimizer(self) -> bool:
        return any(n == "step" or n.startswith(tuple(f"{o}." for o in MOMENTS.values())) for n in self.global_shapes)

    def check_moments(self, params: Sequence[str]) -> None:
        """Both AdamW moments (or Muon's momentum buffer) of every parameter are in the files;
        else one line naming the first lacking."""
        for theirs in ADAM_MOMENTS:
            ours = MOMENTS[theirs]
            for n in params:
                if f"{ours}.{n}" not in self._where and f"muon_m.{n}" not in self._where:
                    raise UserError(f"checkpoint.load_path: the optimizer files of {self.folder} hold no "
                                    f"'{theirs}.{self.expected[n][0].theirs}'; they do not match this model (set "
                                    "checkpoint.no_load_optim: true to load the weights only)")

    def check_shapes(self, shapes) -> None:
        """Every stored part of the model's parameters has the shape the model gives it, and the
        folder holds no weight the model lacks; else one line naming the first that differs."""
        stored = self.reader.global_shapes
        for name, shape in shapes:
            for pl in self._place(name, shape):
                if pl.theirs in stored and tuple(stored[pl.theirs]) != pl.shape:
                    mine = "" if pl.theirs == name else f" (the model's '{name}')"
                    raise UserError(f"checkpoint.load_path: '{pl.theirs}'{mine} has shape {list(stored[pl.theirs])} "
                                    f"in {self.folder}, the model's is {list(pl.shape)}; the checkpoint was written "
                                    "for another model")
        known = {pl.theirs for pls in self.expected.values() for pl in pls}
        for theirs, shape in stored.items():
            if theirs == STEP or theirs.startswith(tuple(f"{t}." for t in MOMENTS)) or theirs in known:
                continue
            if self.mindformers_names:
                names.parts(theirs, shape, self.cfg)  # a name the map does not know: its own line
                if names.is_companion(theirs, self.cfg):
                    continue
            raise UserError(f"checkpoint.load_path: {self.folder} holds '{theirs}', which this model has no "
                            "parameter for; the checkpoint is of another model")

    def check_files(self) -> None:
        """Every chunk is whole in the file metadata.json names, floating point (the step, and
        what MindFormers stores as integers, V4's hash tables, an integer)."""
        tables = tuple(pl.theirs for pls in self.expected.values() for pl in pls if pl.dtype is not None)
        self.reader.check_files(integers=(STEP,) + tables)

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        if name == "step":
            return np.asarray(self.reader.read_full(STEP), np.int64).reshape(())
        pls = self._where[name]
        got = []
        for pl in pls:  # the parts of the box in each MindFormers tensor it is cut into, in order
            clipped = pl.clip(offset, shape)
            if clipped is None:
                continue
            if pl.block != 1:  # one read per block the box crosses (Qwen3's q/k/v in linear_qkv)
                got.append(np.concatenate([self._read(pl, o, s) for o, s in pl.runs(*clipped)], axis=pl.axis))
            else:
                got.append(self._read(pl, *clipped))
        return got[0] if len(got) == 1 else np.concatenate(got, axis=pls[0].axis)

    def _read(self, pl: Placement, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        box_offset, box_shape = pl.box(offset, shape)
        return pl.from_theirs(self.reader.read(pl.theirs, box_offset, box_shape), offset)

    def read_full(self, name: str) -> np.ndarray:
        shape = self.global_shapes[name]
        return self.read(name, (0,) * len(shape), shape)
