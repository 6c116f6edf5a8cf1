"""``train_dataset.dataloader.type: MindDataset``: MindRecord files, read through
``mindspore.dataset.MindDataset``, feeding the same :class:`~mindtrain.data.PretrainingLoader`
as the Megatron path (data-parallel sharding by dp rank, shuffle by seed, resume position).

Here, beside the trainer, so that mindtrain-data stays free of MindSpore.

Records hold ``input_ids`` and optionally ``labels``, ``loss_mask``, ``position_ids``,
``attention_mask`` (the columns named in ``column_names`` are read). Without ``labels``, each
record holds ``seq_length + 1`` tokens and labels are the inputs shifted by one (MindFormers'
pretraining MindRecords); a missing ``loss_mask`` is all ones, missing ``position_ids`` count
0..seq_length-1.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import numpy as np

from mindtrain.config import ConfigError, MindTrainConfig
from mindtrain.data import PretrainingLoader
from mindtrain.data.loader import collate

_PATH = "train_dataset.dataloader"
# Building a MindDataset stops every iterator the process has open (MindSpore's
# _cleanup_the_iterators_if_created): a pipeline built while another loader's prefetch thread
# iterates deadlocked in Iterator.stop (seen in the suite). All pipelines of the process run
# one at a time under this lock (re-entrant: the constructor reads a first sample).
_PIPELINES = threading.RLock()
COLUMNS = ("input_ids", "labels", "loss_mask", "position_ids")


def mindrecord_files(dataset_files: Any) -> list[str]:
    """A .mindrecord file, a list of them, or folders searched recursively (sorted), as
    MindFormers' PyNative MindDataset loader takes them."""
    items = [dataset_files] if isinstance(dataset_files, str) else list(dataset_files or [])
    files: list[str] = []
    for item in items:
        if os.path.isdir(item):
            found = sorted(os.path.join(root, f) for root, _, names in os.walk(item)
                           for f in names if f.endswith(".mindrecord"))
            if not found:
                raise ConfigError(f"{_PATH}.dataset_files", f"folder '{item}' holds no .mindrecord file")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise ConfigError(f"{_PATH}.dataset_files", f"'{item}' does not exist; give a .mindrecord file, a list "
                              "of them, or a folder holding them")
    if not files:
        raise ConfigError(f"{_PATH}.dataset_files", "is empty; give a .mindrecord file, a list, or a folder")
    return files


class MindRecordDataset:
    """Map-style view of MindRecord files: ``len()`` and ``read(indices)`` (one MindDataset
    pipeline per read, records in the order asked)."""

    def __init__(self, files: Sequence[str], column_names: Sequence[str], seq_length: int, vocab_size: int):
        import mindspore.dataset as ds

        self._ds = ds
        self.files = list(files)
        self.seq_length, self.vocab_size = seq_length, vocab_size
        with _PIPELINES:
            self._open(ds, column_names)

    def _open(self, ds, column_names: Sequence[str]) -> None:
        try:
            in_file = ds.MindDataset(self.files, shuffle=False).get_col_names()
        except RuntimeError as err:
            raise ConfigError(f"{_PATH}.dataset_files", f"cannot be read as MindRecord ({self.files[0]}...): "
                              f"{str(err).strip().splitlines()[0]}") from None
        missing = [c for c in column_names if c not in in_file]
        if missing:
            raise ConfigError(f"{_PATH}.column_names", f"{missing} not in the MindRecord files, which hold {in_file}")
        self.read_columns = list(column_names)
        self.columns = list(COLUMNS) + (["attention_mask"] if "attention_mask" in column_names else [])
        self.num_samples = ds.MindDataset(self.files, columns_list=self.read_columns, shuffle=False).get_dataset_size()
        if self.num_samples:
            self.read([0])  # shapes and ids checked before the model is built

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        return self.read([idx])[0]

    def read(self, indices: Sequence[int]) -> list[dict]:
        """The samples at ``indices``, in that order."""
        ds = self._ds
        with _PIPELINES:
            pipe = ds.MindDataset(self.files, columns_list=self.read_columns,
                                  sampler=ds.SubsetSampler([int(i) for i in indices]))
            records = list(pipe.create_dict_iterator(output_numpy=True, num_epochs=1))
        return [self._sample(r) for r in records]

    def _sample(self, record: dict) -> dict:
        n = self.seq_length
        tokens = np.asarray(record["input_ids"]).reshape(-1)
        if "labels" in record:
            inputs, labels = tokens, np.asarray(record["labels"]).reshape(-1)
            want = (n, n)
        else:
            inputs, labels = tokens[:-1], tokens[1:]
            want = (n + 1, None)
        if tokens.size != want[0] or (want[1] is not None and labels.size != want[1]):
            what = "input_ids and labels of" if want[1] else "input_ids (no labels column) of"
            raise ConfigError(f"{_PATH}.dataset_files", f"records need {what} {want[0]} tokens for model.seq_length "
                              f"{n}, got {tokens.size}" + (f" and {labels.size}" if want[1] else ""))
        high = int(max(inputs.max(initial=0), labels.max(initial=0)))
        if high >= self.vocab_size or min(inputs.min(initial=0), labels.min(initial=0)) < 0:
            raise ConfigError(f"{_PATH}.dataset_files", f"token id {high} outside [0, model.vocab_size "
                              f"{self.vocab_size}); tokenize with the model's tokenizer")
        loss_mask = record.get("loss_mask")
        position_ids = record.get("position_ids")
        out = {"input_ids": inputs.astype(np.int32), "labels": labels.astype(np.int32),
               "loss_mask": (np.ones(n, np.float32) if loss_mask is None
                             else np.asarray(loss_mask, np.float32).reshape(-1)),
               "position_ids": (np.arange(n, dtype=np.int32) if position_ids is None
                                else np.asarray(position_ids, np.int32).reshape(-1))}
        if "attention_mask" in record:
            out["attention_mask"] = np.asarray(record["attention_mask"])
        return out


class MindRecordLoader(PretrainingLoader):
    """PretrainingLoader that reads each micro-batch with one MindDataset pipeline."""

    def _load(self, idx: list) -> dict:
        return collate(self.dataset.read(idx))


def build_mind_loader(cfg: MindTrainConfig, dp_rank: int, dp_size: int) -> MindRecordLoader:
    """The loader of a MindDataset ``train_dataset`` for data-parallel rank ``dp_rank``."""
    section, t = cfg.train_dataset, cfg.training
    dl = section.dataloader
    dataset = MindRecordDataset(mindrecord_files(dl.dataset_files), dl.column_names, cfg.model.seq_length,
                                cfg.model.vocab_size)
    return MindRecordLoader(dataset, micro_batch_size=t.local_batch_size, global_batch_size=t.global_batch_size,
                            dp_rank=dp_rank, dp_size=dp_size, drop_remainder=section.drop_remainder,
                            num_workers=section.num_parallel_workers, shuffle=dl.shuffle, seed=t.seed)
