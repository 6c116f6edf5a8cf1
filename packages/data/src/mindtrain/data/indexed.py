"""Megatron's "MMIDIDX" v1 indexed dataset: memory-mapped reader and byte-identical writer.

Layout of ``<prefix>.idx`` (little endian)::

    b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 S sequences | u64 D doc entries
    | i32[S] sequence lengths | i64[S] byte pointers into .bin | i64[D] document indices

``<prefix>.bin`` holds the tokens of all sequences back to back in the dtype.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from typing import Iterable, Optional, Union

import numpy as np

from mindtrain.data.errors import DataFileError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8

# Megatron's DType enum: code -> numpy dtype.
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    """Megatron's code of a numpy dtype."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of "
                         f"{', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())}") from None


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when the vocabulary has fewer than 65500 entries, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


class _Index:
    """Parsed and validated .idx file; arrays are views of one memory map."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DataFileError(path, "index file not found; check the data_path prefix "
                                      "(it must include _text_document and omit .idx/.bin)")
        size = os.path.getsize(path)
        if size < _HEADER_BYTES:
            raise DataFileError(path, f"truncated index: {size} bytes, the header alone needs "
                                      f"{_HEADER_BYTES}; regenerate the dataset")
        with open(path, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if head[:9] != INDEX_HEADER:
            raise DataFileError(path, f"not a Megatron MMIDIDX index (magic {head[:9]!r}); "
                                      "regenerate it with mindtrain-preprocess")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise DataFileError(path, f"unsupported index version {version}; only version 1 is known")
        code = head[17]
        if code not in DTYPE_CODES:
            raise DataFileError(path, f"unknown dtype code {code}; known codes are 1-8")
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_count, self.document_count = struct.unpack("<QQ", head[18:34])
        s, d = self.sequence_count, self.document_count
        need = _HEADER_BYTES + 12 * s + 8 * d
        if size < need:
            raise DataFileError(path, f"truncated index: {size} bytes but {s} sequences and {d} "
                                      f"document entries need {need}; regenerate the dataset")
        # Megatron's multimodal variant appends one int8 mode per sequence; accept and ignore it.
        if size not in (need, need + s):
            raise DataFileError(path, f"index has {size} bytes, expected {need} for {s} sequences "
                                      f"and {d} document entries; the file is damaged")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=s, offset=off)
        off += 4 * s
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=s, offset=off)
        off += 8 * s
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=d, offset=off)
        self._mmap = buf
        di = self.document_indices
        if d < 1 or di[0] != 0 or di[-1] != s or (d > 1 and np.any(di[1:] < di[:-1])):
            raise DataFileError(path, "document indices are not a non-decreasing list from 0 to "
                                      f"the sequence count {s}; the file is damaged")
        if s and np.any(self.sequence_lengths < 0):
            raise DataFileError(path, "negative sequence length; the file is damaged")


class IndexedDataset:
    """Zero-copy reader of ``<prefix>.bin``/``<prefix>.idx``; ``ds[i]`` is a view of sequence i."""

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = str(path_prefix)
        ipath, bpath = idx_path(self.path_prefix), bin_path(self.path_prefix)
        if not os.path.isfile(bpath):
            if not os.path.isfile(ipath):
                raise DataFileError(self.path_prefix, "neither .bin nor .idx exists at this prefix; "
                                    "check data_path (it must include _text_document, without .bin/.idx)")
            raise DataFileError(bpath, "data file not found next to its .idx; copy both files")
        self.index = _Index(ipath)
        self.dtype = self.index.dtype
        self._itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(bpath)
        lengths, pointers = self.index.sequence_lengths, self.index.sequence_pointers
        if len(lengths):
            ends = pointers + lengths.astype(np.int64) * self._itemsize
            if np.any(pointers < 0) or int(ends.max()) > bin_size:
                raise DataFileError(bpath, f"has {bin_size} bytes but the index points up to "
                                           f"{int(ends.max())}; the .bin is truncated or belongs to another .idx")
        total = int(lengths.sum(dtype=np.int64)) * self._itemsize
        if total != bin_size:
            raise DataFileError(bpath, f"has {bin_size} bytes but its index describes {total}; "
                                       "the .bin and .idx do not belong together")
        if bin_size == 0:
            self._tokens = np.empty(0, dtype=self.dtype)
        elif mmap:
            self._tokens = np.memmap(bpath, dtype=self.dtype, mode="r")
        else:
            self._tokens = np.fromfile(bpath, dtype=self.dtype)
        # Element (not byte) offsets make every read one slice of the token array.
        self._starts = pointers // self._itemsize if len(pointers) else pointers
        self._id_range = None

    def __getstate__(self):  # re-open the files in the receiving process instead of copying them
        return {"path_prefix": self.path_prefix, "mmap": isinstance(self._tokens, np.memmap)}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"], mmap=state["mmap"])

    def __len__(self) -> int:
        return self.index.sequence_count

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        if isinstance(idx, (int, np.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous (step 1)")
            lens = self.index.sequence_lengths[start:stop]
            if not len(lens):
                return []
            first = int(self._starts[start])
            flat = self._tokens[first:first + int(lens.sum(dtype=np.int64))]
            return np.split(flat, np.cumsum(lens[:-1], dtype=np.int64))
        raise TypeError(f"unexpected index type {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (a view, no copy)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        size = int(self.index.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"offset {offset} + length {length} outside sequence {idx} of length {size}")
        start = int(self._starts[idx]) + offset
        return self._tokens[start:start + length]

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_tokens(self) -> int:
        return int(self.index.sequence_lengths.sum(dtype=np.int64))

    def token_id_range(self) -> tuple:
        """(smallest, largest) token id in the .bin, or None when it holds no token.

        One pass over the memory-mapped file in bounded chunks (a few GB/s), remembered
        for this object.
        """
        if self._id_range is None and len(self._tokens):
            chunk = 1 << 26
            parts = [(int(c.min()), int(c.max()))
                     for c in (self._tokens[i:i + chunk] for i in range(0, len(self._tokens), chunk))]
            self._id_range = (min(p[0] for p in parts), max(p[1] for p in parts))
        return self._id_range

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a .bin/.idx pair byte-identical to Megatron-Core's IndexedDatasetBuilder.

    ``dtype`` defaults to int32 as in Megatron; pass ``vocab_size`` instead to apply the
    uint16-below-65500 rule.
    """

    def __init__(self, bin_path: str, dtype=None, vocab_size: Optional[int] = None):
        self.dtype = np.dtype(dtype if dtype is not None else optimal_dtype(vocab_size))
        dtype_code(self.dtype)
        self.bin_path = bin_path
        self.data_file = open(bin_path, "wb")
        self.sequence_lengths = array("q")
        self.document_indices = array("q", [0])

    def add_item(self, tokens: Iterable[int]) -> None:
        """Append one sequence (call end_document() after the last of a document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def add_document(self, tokens: Iterable[int], lengths: Iterable[int]) -> None:
        """Append a whole document made of sequences of the given lengths."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(x) for x in lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another dataset of the same dtype."""
        other = _Index(idx_path(path_prefix))
        if other.dtype != self.dtype:
            raise DataFileError(idx_path(path_prefix), f"dtype {other.dtype} differs from the "
                                                       f"builder's {self.dtype}; cannot merge")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.astype(np.int64).tolist())
        self.document_indices.extend((offset + other.document_indices[1:]).tolist())
        del other
        with open(bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the .bin and write the .idx."""
        self.data_file.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int64) if self.sequence_lengths \
            else np.empty(0, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        docs = np.frombuffer(self.document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
