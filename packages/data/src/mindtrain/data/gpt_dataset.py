"""GPT samples from documents, with Megatron-Core 0.16's document/sample/shuffle indices."""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import numpy as np

from mindtrain.config import GPTDatasetConfig
from mindtrain.data.errors import UserError
from mindtrain.data.index_cache import cached_build
from mindtrain.data.indexed import IndexedDataset

DEFAULT_COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids", "attention_mask"]
# Bump when an index algorithm changes so that old cache entries are never reused.
_INDEX_VERSION = 1


def num_epochs_for(num_samples: Optional[int], tokens_per_epoch: int, seq_length: int,
                   extra: int) -> int:
    """Smallest number of epochs that yields ``num_samples`` samples (1 when None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    epochs, tokens = 1, tokens_per_epoch
    while tokens < needed:
        epochs += 1
        tokens += tokens_per_epoch
    return epochs


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Documents repeated num_epochs times and shuffled (the last epoch apart if separate)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int, drop_last_partial: bool = True,
                       extra: int = 1) -> np.ndarray:
    """[num_samples + 1, 2] rows of (position in document_index, token offset) where samples start.

    Same result as Megatron's C++ build_sample_idx: sample k covers flat tokens
    [k*seq_length, (k+1)*seq_length + extra); its start row is the first document whose
    cumulative end reaches k*seq_length + extra, so one searchsorted finds every row.
    """
    total = num_epochs * tokens_per_epoch - extra
    if drop_last_partial:
        num_samples = total // seq_length
    else:
        num_samples = int(np.ceil(np.float32(total) / np.float32(seq_length)))
    limit = max(document_index.shape[0], int(sizes.max()) if len(sizes) else 0)
    dtype = np.int32 if limit <= np.iinfo(np.int32).max else np.int64
    doc_ends = np.cumsum(sizes[document_index], dtype=np.int64)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(doc_ends, starts + extra, side="left")
    past = rows >= len(doc_ends)
    rows[past] = len(doc_ends) - 1
    offsets = starts - np.where(rows > 0, doc_ends[rows - 1], 0)
    if past.any():  # a partial last sample ends at the end of the final document
        offsets[past] = int(sizes[document_index[-1]]) - extra
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0] = rows
    out[:, 1] = offsets
    out[0] = 0
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples), followed by one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: Optional[int],
                  seq_length: int, seed: int, extra: int = 1, drop_last_partial: bool = True) -> dict:
    """Megatron's document, sample and shuffle indices for one split of one dataset."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch <= extra:
        raise UserError(f"the split holds {tokens_per_epoch} tokens, too few for one sample; "
                        "add data or change split")
    num_epochs = num_epochs_for(num_samples, tokens_per_epoch, seq_length, extra)
    separate_final_epoch = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - extra) // seq_length
        assert 0 <= from_final <= per_epoch + 1
        separate_final_epoch = from_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sizes, document_index, seq_length, num_epochs,
                                      tokens_per_epoch, drop_last_partial, extra)
    n = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate_final_epoch else n, n, rng)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def ltor_masks_and_position_ids(tokens: np.ndarray, eod: int, reset_position_ids: bool,
                                reset_attention_mask: bool, eod_mask_loss: bool,
                                create_attention_mask: bool):
    """(attention_mask [1,S,S] bool with True = masked, or None; loss_mask f32; position_ids i64)."""
    s = tokens.shape[0]
    is_eod = tokens == eod
    loss_mask = np.ones(s, dtype=np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = np.arange(s, dtype=np.int64)
    if reset_position_ids:
        # Each position counts from the token after the latest earlier EOD.
        doc_start = np.zeros(s, dtype=np.int64)
        after = np.flatnonzero(is_eod[:-1]) + 1
        doc_start[after] = after
        np.maximum.accumulate(doc_start, out=doc_start)
        position_ids -= doc_start
    attention_mask = None
    if create_attention_mask:
        causal = np.tri(s, s, dtype=bool)
        if reset_attention_mask:
            # Query q sees key k only if no EOD lies in [k, q): same count of EODs before both.
            seg = np.concatenate(([0], np.cumsum(is_eod[:-1], dtype=np.int64)))
            causal &= seg[:, None] == seg[None, :]
        attention_mask = ~causal[None]
    return attention_mask, loss_mask, position_ids


def compressed_eod_mask(tokens: np.ndarray, eod: int, eod_pad_length: int) -> np.ndarray:
    """End positions of the documents in a sample (final EOD excluded), padded with seq_length.

    This is MindSpore Transformers' ``actual_seq_len`` form of the packed-document mask.
    """
    ends = np.flatnonzero(tokens == eod) + 1
    if tokens.shape[0] and tokens[-1] == eod:
        ends = ends[:-1]
    if len(ends) > eod_pad_length:
        raise UserError(f"train_dataset.dataloader.config.eod_pad_length: a sample holds {len(ends)} "
                        f"document ends, more than eod_pad_length={eod_pad_length}; raise it")
    out = np.full(eod_pad_length, tokens.shape[0], dtype=np.int32)
    out[:len(ends)] = ends
    return out


def index_cache_dir(prefix: str, path_to_cache: Optional[str], kind: str) -> str:
    if path_to_cache:
        return path_to_cache
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", f"{kind}_indices")


def _file_stamp(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


class GPTDataset:
    """Fixed-length samples drawn from a split of one IndexedDataset, exactly as Megatron-Core.

    ``ds[i]`` is a dict of numpy arrays keyed by ``column_names`` in this order: input ids
    (int32), labels (int32), loss mask (float32), position ids (int32) and, when created,
    the attention mask ([1,S,S] bool, True = masked) or the compressed EOD mask (int32).
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: Optional[int],
                 config: GPTDatasetConfig, split_name: str = "train",
                 column_names: Optional[list] = None, cache: bool = True):
        self.indexed = indexed
        self.config = config
        self.split_name = split_name
        self.num_samples = num_samples
        self.seq_length = int(config.seq_length)
        self.extra = int(bool(config.add_extra_token_to_sequence))
        self.eod = int(config.eod)
        self.pad = int(config.pad)
        if self.pad == self.eod:
            # Megatron-Core refuses a pad id that collides with a special token.
            warnings.warn(f"pad id {self.pad} equals the eod id; padding is not masked (pad = -1), "
                          "as in Megatron-Core")
            self.pad = -1
        wants_mask = config.create_attention_mask or config.create_compressed_eod_mask
        names = list(column_names) if column_names else DEFAULT_COLUMNS[:4 + wants_mask]
        self.column_names = names
        description = json.dumps({
            "class": "GPTDataset", "index_version": _INDEX_VERSION,
            "idx": _file_stamp(indexed.path_prefix + ".idx"),
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)] if len(documents) else [],
            "num_samples": num_samples, "split": split_name, "seed": int(config.seed),
            "seq_length": self.seq_length, "add_extra_token_to_sequence": self.extra,
        }, indent=2)
        sizes = indexed.sequence_lengths
        cache_dir = index_cache_dir(indexed.path_prefix, config.path_to_cache, "GPTDataset") if cache else None
        arrays, self.built_indices = cached_build(
            cache_dir, description, f"GPTDataset-{split_name}",
            ["document_index", "sample_index", "shuffle_index"],
            lambda: build_indices(sizes, documents, num_samples, self.seq_length,
                                  int(config.seed), self.extra))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._cacheable = not (config.reset_position_ids or config.reset_attention_mask
                               or config.eod_mask_loss)
        self._cached = None

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens(self, idx: int) -> np.ndarray:
        """The seq_length + extra raw token ids of sample ``idx`` (int64, pad-filled)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        j = int(self.shuffle_index[idx])
        beg, beg_off = self.sample_index[j]
        end, end_off = self.sample_index[j + 1]
        beg, beg_off, end, end_off = int(beg), int(beg_off), int(end), int(end_off)
        want = self.seq_length + self.extra
        out = np.empty(want, dtype=np.int64)
        docs, get = self.document_index, self.indexed.get
        if beg == end:
            part = get(int(docs[beg]), beg_off, end_off - beg_off + self.extra)
            n = part.shape[0]
            out[:n] = part
        else:
            n = 0
            for i in range(beg, end + 1):
                off = beg_off if i == beg else 0
                length = end_off + self.extra if i == end else None
                part = get(int(docs[i]), off, length)
                out[n:n + part.shape[0]] = part
                n += part.shape[0]
        if n < want:
            out[n:] = self.pad
        return out

    def __getitem__(self, idx: int) -> dict:
        text = self.tokens(int(idx))
        if self.extra:
            tokens, labels = text[:-1], text[1:].copy()
        else:
            tokens = text
            labels = np.roll(text, -1)
            labels[-1] = self.pad
        c = self.config
        if self._cacheable and self._cached is not None:
            attention_mask, loss_mask, position_ids = self._cached
            loss_mask = loss_mask.copy()
        else:
            attention_mask, loss_mask, position_ids = ltor_masks_and_position_ids(
                tokens, self.eod, c.reset_position_ids, c.reset_attention_mask, c.eod_mask_loss,
                c.create_attention_mask)
            position_ids = position_ids.astype(np.int32)
            if self._cacheable:
                # Shared by every later sample, so frozen against writes by callers.
                position_ids.flags.writeable = False
                if attention_mask is not None:
                    attention_mask.flags.writeable = False
                self._cached = (attention_mask, loss_mask.copy(), position_ids)
        compressed = (compressed_eod_mask(tokens, self.eod, c.eod_pad_length)
                      if c.create_compressed_eod_mask else None)
        pad = self.pad
        is_pad = labels == pad
        if is_pad.any():
            loss_mask[is_pad] = 0.0
            labels[is_pad] = 0
        tokens = tokens.astype(np.int32)
        tokens[tokens == pad] = 0
        values = [tokens, labels.astype(np.int32), loss_mask, position_ids]
        if c.create_compressed_eod_mask:
            values.append(compressed)
        elif c.create_attention_mask:
            values.append(attention_mask)
        return dict(zip(self.column_names, values))
