"""The check that a dataset's token ids fit the model's embedding table."""

from __future__ import annotations

from mindtrain.data.errors import DataFileError
from mindtrain.data.indexed import IndexedDataset, bin_path


def indexed_files(dataset) -> list:
    """The distinct IndexedDatasets under a GPTDataset, BlendedDataset or IndexedDataset."""
    if isinstance(dataset, IndexedDataset):
        return [dataset]
    if hasattr(dataset, "datasets"):
        found = [f for member in dataset.datasets for f in indexed_files(member)]
    else:
        found = [dataset.indexed]
    unique = {}
    for f in found:
        unique.setdefault(f.path_prefix, f)
    return list(unique.values())


def check_token_ids(dataset, vocab_size: int) -> None:
    """Raise DataFileError naming the .bin whose ids fall outside ``[0, vocab_size)``.

    An embedding lookup with such an id fails deep inside the device kernel, far from the
    cause; one pass over each memory-mapped file here costs well under a second per GB.
    """
    for f in indexed_files(dataset):
        # an unsigned file whose dtype cannot hold an id >= vocab_size needs no scan
        if f.dtype.kind == "u" and (1 << (8 * f.dtype.itemsize)) <= vocab_size:
            continue
        bounds = f.token_id_range()
        if bounds is None:
            continue
        low, high = bounds
        if high >= vocab_size:
            raise DataFileError(bin_path(f.path_prefix), f"largest token id {high} does not fit model.vocab_size "
                                f"{vocab_size} (ids must be < {vocab_size}); tokenize with the model's tokenizer "
                                "or set model.vocab_size to at least " + str(high + 1))
        if low < 0:
            raise DataFileError(bin_path(f.path_prefix), f"holds a negative token id ({low}); the file is damaged "
                                "or was written with the wrong dtype")
