"""Token ids against the model's vocab size: the max-id query on the .bin and the check."""

import numpy as np
import pytest

from mindtrain.data import DataFileError, IndexedDataset, IndexedDatasetBuilder, build_dataset, check_token_ids


def _write(prefix, docs, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(d, [len(d)])
    b.finalize(prefix + ".idx")
    return prefix


def test_token_id_range_reads_the_whole_file(tmp_path):
    rng = np.random.RandomState(0)
    docs = [rng.randint(5, 900, size=rng.randint(1, 50)) for _ in range(200)]
    docs[137][3] = 4321
    ds = IndexedDataset(_write(str(tmp_path / "a"), docs, np.int32))
    assert ds.token_id_range() == (int(np.concatenate(docs).min()), 4321)
    assert IndexedDataset(_write(str(tmp_path / "e"), [], np.uint16)).token_id_range() is None


def test_check_names_the_file_the_largest_id_and_the_vocab(tmp_path):
    good = _write(str(tmp_path / "good_text_document"), [[3, 4, 1], [7, 1]], np.uint16)
    bad = _write(str(tmp_path / "bad_text_document"), [[3, 600, 1], [9, 1]], np.uint16)
    section = {"dataloader": {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                              "sizes": [4, 0, 0], "config": {"seq_length": 2, "split": "1, 0, 0", "eod": 1,
                                                             "data_path": ["1", good, "1", bad],
                                                             "path_to_cache": str(tmp_path / "cache")}}}
    ds = build_dataset(section)
    check_token_ids(ds, 601)
    with pytest.raises(DataFileError) as err:
        check_token_ids(ds, 600)
    assert str(err.value).startswith(bad + ".bin: largest token id 600 does not fit model.vocab_size 600")
    neg = _write(str(tmp_path / "neg"), [[3, -5, 1]], np.int32)
    with pytest.raises(DataFileError, match="negative token id"):
        check_token_ids(IndexedDataset(neg), 10)
