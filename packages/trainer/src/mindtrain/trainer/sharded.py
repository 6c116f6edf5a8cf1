"""Sharded checkpoint files: each rank writes the pieces it holds, ``metadata.json`` says where.

A piece is a box of a full tensor (:class:`mindtrain.parallel.Shard`: name, global shape,
offset, shape). Every rank writes the pieces it is the first holder of (replicas are written
once) into ``model-{rank:07d}-{world:07d}.safetensors`` and ``opt-...`` (AdamW's moments;
a rank with two boxes of one tensor writes a second pair, :func:`plan_files`);
``metadata.json`` is MindFormers' PyNative format (``mindformers/checkpoint/``): per tensor
its global shape, chunks (``global_offset``, ``local_shape``) and, when they cut it evenly,
MindSpore's layout of them (:func:`grid_layout`), and per chunk the file that stores it. A
rank that loads reads, through a memory map, only the parts of the files that overlap the
boxes it holds, so any layout and world size loads any other's checkpoint.

Files are written tensor by tensor, each made when its turn comes (:class:`Lazy`; no copy
of the whole file is built), so a save holds nothing beyond the rank's own share. numpy and
json only.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from mindtrain.config import UserError

METADATA_FILE = "metadata.json"
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in ST_DTYPES.items()}
# str(mindspore dtype) as MindFormers stores it in metadata.json
_MS_NAMES = {np.dtype(np.float32): "Float32", np.dtype(np.float16): "Float16", np.dtype(np.float64): "Float64",
             np.dtype(np.int64): "Int64", np.dtype(np.int32): "Int32", np.dtype(np.int8): "Int8",
             np.dtype(np.uint8): "UInt8", np.dtype(np.bool_): "Bool"}


def file_name(prefix: Optional[str], kind: str, rank: int, world: int) -> str:
    """``{prefix}-{model|opt}-{rank:07d}-{world:07d}.safetensors`` (MindFormers' names)."""
    body = f"{kind}-{rank:07d}-{world:07d}.safetensors"
    return f"{prefix}-{body}" if prefix else body


# ---------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class Piece:
    """One box of one tensor, as the ranks tell each other before a save."""

    kind: str  # "model" or "opt": the file it goes to
    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name

    @property
    def key(self) -> tuple:
        return (self.kind, self.name, self.offset, self.shape)

    def to_json(self) -> list:
        return [self.kind, self.name, list(self.global_shape), list(self.offset), list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, j: list) -> "Piece":
        return cls(j[0], j[1], tuple(j[2]), tuple(j[3]), tuple(j[4]), j[5])


def writers(everyone: Sequence[Sequence[Piece]]) -> dict[tuple, int]:
    """The rank that writes each distinct piece: the first (lowest) that holds it."""
    out: dict[tuple, int] = {}
    for rank, pieces in enumerate(everyone):
        for p in pieces:
            out.setdefault(p.key, rank)
    return out


@dataclass
class FilePlan:
    """Who writes each distinct piece (by :attr:`Piece.key`), into which file, and which ranks
    hold it (its ``rank_group`` in metadata.json)."""

    writer: dict[tuple, int]
    file: dict[tuple, str]
    holders: dict[tuple, list[int]]

    def written(self, everyone: Sequence[Sequence[Piece]]) -> list[Piece]:
        """Every distinct piece once, as its writer listed it."""
        return [p for r, ps in enumerate(everyone) for p in ps if self.writer[p.key] == r]

    def metadata(self, everyone: Sequence[Sequence[Piece]]) -> dict:
        return metadata(self.written(everyone), lambda p: self.file[p.key], len(everyone),
                        storage_rank=lambda p: self.writer[p.key], rank_group=lambda p: self.holders[p.key])


def plan_files(everyone: Sequence[Sequence[Piece]], prefix: Optional[str] = None) -> FilePlan:
    """The files of a save, from every rank's pieces (the same list on every rank). A piece is
    written once, by the lowest rank that holds it; a rank's pieces go to
    ``{prefix}-{kind}-{r:07d}-{world:07d}.safetensors``. A file holds one box per tensor, so a
    rank that writes ``n`` boxes of one tensor (the parts of a fused MindFormers tensor that are
    not one box) puts box ``j`` into file ``j * world + r`` of ``n * world`` (MindFormers names
    files by index and count as its balanced save does)."""
    world = len(everyone)
    writer = writers(everyone)
    holders: dict[tuple, list[int]] = {}
    for rank, pieces in enumerate(everyone):
        for p in pieces:
            holders.setdefault(p.key, []).append(rank)
    slot: dict[tuple, int] = {}
    count: dict[tuple, int] = {}
    for rank, pieces in enumerate(everyone):
        for p in sorted(pieces, key=lambda p: p.offset):
            if writer[p.key] == rank and p.key not in slot:
                k = (p.kind, rank, p.name)
                slot[p.key] = count.get(k, 0)
                count[k] = slot[p.key] + 1
    slots: dict[str, int] = {}
    for (kind, _, _), n in count.items():
        slots[kind] = max(slots.get(kind, 1), n)
    files = {key: file_name(prefix, key[0], slot[key] * world + writer[key], slots[key[0]] * world) for key in slot}
    return FilePlan(writer, files, holders)


@dataclass(frozen=True)
class Lazy:
    """A tensor to write whose values are made only when its turn comes (``get()``)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    get: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


def write_safetensors(path: str, tensors: Iterable[tuple[str, Union[np.ndarray, "Lazy"]]],
                      metadata: Optional[dict[str, str]] = None) -> None:
    """A safetensors file of the arrays (or :class:`Lazy` ones, made in turn), written tensor
    by tensor (no whole-file buffer), fsynced."""
    write_lazy(path, [Lazy(n, tuple(a.shape), np.dtype(a.dtype), a.get if isinstance(a, Lazy) else (lambda a=a: a))
                      for n, a in tensors], metadata)


def write_lazy(path: str, tensors: Sequence[Lazy], metadata: Optional[dict[str, str]] = None) -> None:
    """A safetensors file whose tensors are made one at a time while it is written, fsynced:
    the memory it takes is one tensor's."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    start = 0
    for t in tensors:
        dt = np.dtype(t.dtype)
        if dt not in _ST_NAMES:
            raise TypeError(f"{t.name}: dtype {dt} has no safetensors name")
        header[t.name] = {"dtype": _ST_NAMES[dt], "shape": list(t.shape), "data_offsets": [start, start + t.nbytes]}
        start += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            a = np.asarray(t.get(), t.dtype, order="C")
            if tuple(a.shape) != tuple(t.shape):
                raise ValueError(f"{t.name}: made with shape {a.shape}, announced {t.shape}")
            f.write(memoryview(a.reshape(-1)).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def metadata(pieces: Iterable[Piece], file_of: Callable[[Piece], str], world: int,
             storage_rank: Optional[Callable[[Piece], int]] = None,
             rank_group: Optional[Callable[[Piece], list[int]]] = None) -> dict:
    """metadata.json (MindFormers' layout) for the written ``pieces``: the rank that stored
    each (default: the one its file is named after) and the ranks that hold it (default: all)."""
    state: dict = {}
    storage: dict = {}
    holders: dict[str, list] = {}
    for p in pieces:
        group = rank_group(p) if rank_group else list(range(world))
        holders.setdefault(p.name, []).append((p.offset, p.shape, group))
        entry = state.setdefault(p.name, {
            "properties": {"dtype": _MS_NAMES.get(np.dtype(p.dtype), p.dtype), "replica_id": 0,
                           "allow_shape_mismatch": False, "allow_to_save": True},
            "global_shape": list(p.global_shape),
            "axis_fragmentations": [1] * len(p.global_shape), "layout": None, "chunk": []})
        entry["chunk"].append({"global_offset": list(p.offset) or [0], "local_shape": list(p.shape)})
        fname = file_of(p)
        storage[shard_id(p.name, p.offset)] = [{
            "file_name": fname, "storage_rank": storage_rank(p) if storage_rank else rank_of_file(fname),
            "rank_group": group}]
    for name, entry in state.items():  # how many pieces each dimension is cut into
        g = entry["global_shape"]
        for d in range(len(g)):
            cuts = {tuple(c["global_offset"])[d] for c in entry["chunk"]}
            entry["axis_fragmentations"][d] = len(cuts)
        entry["layout"] = grid_layout(tuple(g), holders[name])
    return {"state_dict_metadata": state, "storage_data": storage}


def grid_layout(global_shape: tuple[int, ...], chunks: Sequence[tuple[tuple, tuple, Sequence[int]]]
                ) -> Optional[dict]:
    """The layout MindFormers' loader reads a tensor's chunks by (MindSpore's ``Layout.to_dict``:
    a device matrix, which of its axes cuts each tensor dimension, and the ranks in device-matrix
    order), for ``chunks`` ``(offset, shape, ranks holding it)`` that cut every dimension into
    equal parts, each held by as many ranks: the matrix is the cuts of each cut dimension, then
    the replicas; the first rank of each chunk, its writer, is its replica 0. None for any
    other cutting (the two FSDP-sharded parts of ``linear_qkv``, a rank's two TP-cut halves of
    ``weight1``), which only mindtrain reads (MindFormers takes a tensor without a layout to be whole in rank 0's file)."""
    if not global_shape:
        return None
    size = []
    for d, n in enumerate(global_shape):
        sizes = {c[1][d] for c in chunks}
        k = sizes.pop()
        if sizes or not 0 < k <= n or n % k:
            return None
        size.append(k)
    cuts = [n // k for n, k in zip(global_shape, size)]
    cell = {tuple(o // k for o, k in zip(c[0], size)): sorted(c[2]) for c in chunks
            if all(o % k == 0 for o, k in zip(c[0], size))}
    replicas = {len(r) for r in cell.values()}
    if len(cell) != len(chunks) or len(cell) != math.prod(cuts) or len(replicas) != 1:
        return None
    reps = replicas.pop()
    axes = [d for d in range(len(cuts)) if cuts[d] > 1]
    matrix = [cuts[d] for d in axes] + ([reps] if reps > 1 or not axes else [])
    alias = [f"dim{d}" for d in axes] + (["replica"] if reps > 1 or not axes else [])
    tensor_map = [len(matrix) - 1 - axes.index(d) if d in axes else -1 for d in range(len(cuts))]
    ranks = [r for index in itertools.product(*(range(cuts[d]) for d in axes))
             for r in cell[tuple(index[axes.index(d)] if d in axes else 0 for d in range(len(cuts)))]]
    if len(set(ranks)) != len(ranks):  # a rank holding two chunks (weight1's two TP-cut halves)
        return None
    return {"device_matrix": matrix, "tensor_map": tensor_map, "interleaved_parallel": False,
            "alias_name": alias, "rank_list": ranks}


_RANK = re.compile(r"-(\d{7})-\d{7}\.safetensors$")


def rank_of_file(fname: str) -> int:
    m = _RANK.search(fname)
    return int(m.group(1)) if m else 0


def shard_id(name: str, offset: Sequence[int]) -> str:
    """MindFormers keys storage_data by ``str((name, tuple(offset)))``."""
    return str((name, tuple(int(x) for x in (offset or (0,)))))


_SHARD_ID = re.compile(r"^\('(?P<name>.*)', \((?P<offset>[\d, ]*)\)\)$")


def parse_shard_id(key: str) -> tuple[str, tuple[int, ...]]:
    m = _SHARD_ID.match(key)
    if not m:
        raise UserError(f"checkpoint.load_path: metadata.json has a storage_data key '{key}' that is not "
                        "('name', (offsets)); the file is not MindFormers' metadata")
    return m.group("name"), tuple(int(x) for x in m.group("offset").replace(" ", "").split(",") if x)


# ---------------------------------------------------------------------------- reading

@dataclass
class _Chunk:
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: str


class ShardedReader:
    """Boxes of the tensors of a sharded checkpoint folder, read from the files that hold them.

    The chunks are those metadata.json lists; a folder without one (MindFormers writes none
    for one card) gives ``whole_files``, each holding whole tensors."""

    def __init__(self, folder: str, whole_files: Optional[Sequence[str]] = None):
        self.folder = folder
        self.global_shapes: dict[str, tuple[int, ...]] = {}
        self.chunks: dict[str, list[_Chunk]] = {}
        self._headers: dict[str, tuple[dict, int]] = {}
        path = os.path.join(folder, METADATA_FILE)
        if whole_files is not None and not os.path.isfile(path):
            for fname in whole_files:
                header, _ = self._header(fname, fname)
                for name, info in header.items():
                    if name in self.chunks:
                        raise UserError(f"checkpoint.load_path: '{name}' is in both {self.chunks[name][0].file} "
                                        f"and {fname} of {folder}, which has no {METADATA_FILE} to say which "
                                        "part each holds; the folder mixes two checkpoints")
                    shape = tuple(int(x) for x in info["shape"])
                    self.global_shapes[name] = shape
                    self.chunks[name] = [_Chunk((0,) * len(shape), shape, fname)]
            return
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
            file_of = {parse_shard_id(key): stores[0]["file_name"] for key, stores in meta["storage_data"].items()}
            chunks = {name: (tuple(int(x) for x in entry["global_shape"]),
                             [(tuple(int(x) for x in c["global_offset"]), tuple(int(x) for x in c["local_shape"]))
                              for c in entry["chunk"]])
                      for name, entry in meta["state_dict_metadata"].items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise UserError(f"checkpoint.load_path: '{path}' is damaged or not a sharded checkpoint's "
                            f"metadata ({type(err).__name__}: {str(err)[:120]}); restore it") from None
        for name, (g, boxes) in chunks.items():
            self.global_shapes[name] = g
            for off, shape in boxes:
                fname = file_of.get((name, off))
                if fname is None:
                    raise UserError(f"checkpoint.load_path: {path} lists a chunk of '{name}' at offset "
                                    f"{list(off)} that no file stores; the checkpoint is incomplete")
                self.chunks.setdefault(name, []).append(_Chunk(off[:len(g)], shape, fname))

    def names(self) -> list[str]:
        return list(self.global_shapes)

    def check_shapes(self, shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Each named tensor is in the checkpoint with this full shape; else one line naming
        the first that is missing or differs."""
        for name, shape in shapes:
            if name not in self.global_shapes:
                raise UserError(f"checkpoint.load_path: {self.folder} holds no '{name}'; the checkpoint is of "
                                "another model (set checkpoint.no_load_optim or load_path to one of this model)")
            if tuple(self.global_shapes[name]) != tuple(shape):
                raise UserError(f"checkpoint.load_path: '{name}' has shape {list(self.global_shapes[name])} in "
                                f"{self.folder}, the model's is {list(shape)}; the checkpoint was written for "
                                "another model")

    def check_files(self, names: Optional[Iterable[str]] = None, integers: Sequence[str] = ("step",)) -> None:
        """Every chunk of the tensors ``names`` (default: all) is in the file metadata.json
        names, whole, with its shape and a floating-point dtype (the counters ``integers`` an
        integer): a damaged or mismatched checkpoint is one line before any tensor is read."""
        for name in (self.names() if names is None else names):
            for c in self.chunks.get(name, ()):
                src = self._tensor(c.file, name)
                path = os.path.join(self.folder, c.file)
                if tuple(src.shape) != tuple(c.shape):
                    raise UserError(f"checkpoint.load_path: '{name}' in '{path}' has shape {list(src.shape)}, "
                                    f"metadata.json says {list(c.shape)}; the checkpoint is damaged")
                if name not in integers and src.dtype.kind != "f" and not self._is_bf16(c.file, name):
                    raise UserError(f"checkpoint.load_path: '{name}' in '{path}' is {src.dtype}, but the model's "
                                    "parameters are floating point; the checkpoint is damaged or of another model")

    def read(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        """The box ``offset``/``shape`` of tensor ``name`` (float32 for BF16), assembled from
        the chunks that overlap it; only those parts of the files are read."""
        if name not in self.chunks:
            raise UserError(f"checkpoint.load_path: {self.folder} holds no '{name}'; the checkpoint is of another "
                            "model")
        offset, shape = tuple(offset), tuple(shape)
        out: Optional[np.ndarray] = None
        covered = 0
        for c in self.chunks[name]:
            lo = [max(a, b) for a, b in zip(offset, c.offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, c.offset, c.shape)]
            if any(h <= low for low, h in zip(lo, hi)) and shape:
                continue
            src = self._tensor(c.file, name)
            part = src[tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, c.offset))]
            part = bf16_to_float32(part) if src.dtype == np.uint16 and self._is_bf16(c.file, name) else part
            if out is None:
                out = np.empty(shape, part.dtype if part.dtype != np.uint16 else np.float32)
            out[tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offset))] = part
            covered += int(math.prod(h - a for a, h in zip(lo, hi)))
        need = int(math.prod(shape))
        if out is None or covered < need:
            files = sorted({c.file for c in self.chunks[name]})
            raise UserError(f"checkpoint.load_path: the chunks of '{name}' in {self.folder} cover "
                            f"{covered} of the {need} elements at offset {list(offset)} (files {', '.join(files)}); "
                            "the checkpoint is incomplete")
        return out

    def read_all(self, names: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
        """Whole tensors by name (all, or ``names``): for tools and tests, not for training."""
        return {n: self.read_full(n) for n in (self.names() if names is None else names)}

    def read_full(self, name: str) -> np.ndarray:
        g = self.global_shapes[name]
        return self.read(name, (0,) * len(g), g)

    def _is_bf16(self, fname: str, name: str) -> bool:
        header, _ = self._header(fname, name)
        return header[name]["dtype"] == "BF16"

    def _header(self, fname: str, name: str) -> tuple[dict, int]:
        if fname not in self._headers:
            path = os.path.join(self.folder, fname)
            if not os.path.isfile(path):
                raise UserError(f"checkpoint.load_path: '{name}' is stored in '{path}', which is missing; "
                                "the checkpoint is incomplete")
            self._headers[fname] = read_header(path)
        return self._headers[fname]

    def _tensor(self, fname: str, name: str) -> np.ndarray:
        header, base = self._header(fname, name)
        path = os.path.join(self.folder, fname)
        if name not in header:
            raise UserError(f"checkpoint.load_path: '{path}' holds no tensor '{name}' although metadata.json "
                            "says it does; the checkpoint is damaged")
        info = header[name]
        start, end = info["data_offsets"]
        dtype = np.uint16 if info["dtype"] == "BF16" else ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise UserError(f"checkpoint.load_path: '{path}' stores '{name}' as {info['dtype']}, which "
                            "mindtrain does not read (float/int types and BF16 are read)")
        shape = tuple(info["shape"])
        if base + end > os.path.getsize(path) or end - start != int(math.prod(shape)) * np.dtype(dtype).itemsize:
            raise UserError(damaged_message(path, ValueError(f"'{name}' runs past the end of the file")))
        if end == start:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)


def read_header(path: str) -> tuple[dict, int]:
    """(tensor entries, offset of the data) of a safetensors file; a damaged header is the
    damaged-file line."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        try:
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        except ValueError as err:
            raise UserError(damaged_message(path, err)) from None
    header.pop("__metadata__", None)
    return header, 8 + n


def bf16_to_float32(bf16: np.ndarray) -> np.ndarray:
    """BF16 values stored as uint16 (numpy has no bfloat16), widened to float32."""
    return (np.asarray(bf16, np.uint16).astype(np.uint32) << 16).view(np.float32)


def damaged_message(path: str, err: BaseException) -> str:
    """The one line for a checkpoint file that cannot be read back."""
    why = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
    return (f"checkpoint.load_path: '{path}' is damaged (truncated or corrupted: {why}); restore it, "
            "or resume from an earlier iteration folder")


def is_sharded(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, METADATA_FILE))


def boxes(pieces: Iterable[Piece]) -> Iterator[Piece]:
    """The non-empty ones (an FSDP shard past the last row holds nothing)."""
    return (p for p in pieces if all(n > 0 for n in p.shape) or not p.shape)
