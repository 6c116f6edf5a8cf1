"""The MMIDIDX reader and writer against files written by Megatron-Core's builder."""

import os
import shutil

import numpy as np
import pytest

from mindtrain.config import UserError
from mindtrain.data import DataFileError, IndexedDataset, IndexedDatasetBuilder, optimal_dtype


def _documents(ds):
    """[(tokens, sequence lengths)] per document."""
    di = ds.document_indices
    return [(np.concatenate([ds[j] for j in range(di[d], di[d + 1])]) if di[d + 1] > di[d] else np.empty(0),
             [int(x) for x in ds.sequence_lengths[di[d]:di[d + 1]]]) for d in range(len(di) - 1)]


@pytest.mark.parametrize("name,dtype", [("corpus_a", np.uint16), ("corpus_int32", np.int32)])
def test_reader_reads_megatron_files(fixtures_dir, name, dtype):
    ds = IndexedDataset(os.path.join(fixtures_dir, name))
    assert ds.dtype == np.dtype(dtype)
    raw = np.fromfile(os.path.join(fixtures_dir, name + ".bin"), dtype=dtype)
    assert ds.num_tokens == raw.size == int(ds.sequence_lengths.sum())
    assert np.array_equal(np.concatenate(ds[0:len(ds)]), raw)
    i = len(ds) // 2
    assert np.array_equal(ds.get(i, 1, 2), ds[i][1:3])
    assert isinstance(ds[i], np.memmap) or ds[i].base is not None  # a view, not a copy
    assert not ds[i].flags.writeable
    with pytest.raises(IndexError):
        ds.get(i, 0, int(ds.sequence_lengths[i]) + 1)
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize("name,dtype", [("corpus_a", np.uint16), ("corpus_int32", np.int32)])
def test_builder_is_byte_identical_to_megatron(fixtures_dir, tmp_path, name, dtype):
    src = IndexedDataset(os.path.join(fixtures_dir, name))
    out = str(tmp_path / name)
    b = IndexedDatasetBuilder(out + ".bin", dtype=dtype)
    for d, (tokens, lengths) in enumerate(_documents(src)):
        if len(lengths) > 1 and d % 2:
            start = 0
            for n in lengths:  # item by item, as Megatron's add_item/end_document
                b.add_item(tokens[start:start + n])
                start += n
            b.end_document()
        else:
            b.add_document(tokens, lengths)
    b.finalize(out + ".idx")
    for ext in (".bin", ".idx"):
        with open(out + ext, "rb") as f1, open(os.path.join(fixtures_dir, name + ext), "rb") as f2:
            assert f1.read() == f2.read(), ext


def test_add_index_merge_is_byte_identical(fixtures_dir, tmp_path):
    out = str(tmp_path / "merged")
    b = IndexedDatasetBuilder(out + ".bin", dtype=np.uint16)
    b.add_index(os.path.join(fixtures_dir, "corpus_a"))
    b.add_index(os.path.join(fixtures_dir, "corpus_b"))
    b.finalize(out + ".idx")
    for ext in (".bin", ".idx"):
        with open(out + ext, "rb") as f1, open(os.path.join(fixtures_dir, "merged_ab" + ext), "rb") as f2:
            assert f1.read() == f2.read(), ext


def test_every_dtype_code_round_trips(tmp_path):
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16):
        out = str(tmp_path / np.dtype(dtype).name)
        b = IndexedDatasetBuilder(out + ".bin", dtype=dtype)
        b.add_document([1, 2, 3], [3])
        b.add_document([], [])
        b.add_document([4, 5], [1, 1])
        b.finalize(out + ".idx")
        ds = IndexedDataset(out)
        assert ds.dtype == np.dtype(dtype) and len(ds) == 3
        assert ds.document_indices.tolist() == [0, 1, 1, 3]
        assert [x.tolist() for x in ds[0:3]] == [[1, 2, 3], [4], [5]]


def test_default_dtype_rule(tmp_path):
    assert optimal_dtype(65499) is np.uint16 and optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32
    assert IndexedDatasetBuilder(str(tmp_path / "a.bin"), vocab_size=259).dtype == np.uint16
    assert IndexedDatasetBuilder(str(tmp_path / "b.bin")).dtype == np.int32  # Megatron's default


def _copy(fixtures_dir, tmp_path, name="corpus_a"):
    prefix = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        shutil.copy(os.path.join(fixtures_dir, name + ext), prefix + ext)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage,needle", [
    (lambda p: _patch(p + ".idx", 0, b"XXXXXXX"), "MMIDIDX"),
    (lambda p: _patch(p + ".idx", 9, (2).to_bytes(8, "little")), "version 2"),
    (lambda p: _patch(p + ".idx", 17, bytes([9])), "dtype code 9"),
    (lambda p: os.truncate(p + ".idx", 100), "truncated index"),
    (lambda p: os.truncate(p + ".idx", 20), "truncated index"),
    (lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 2), ".bin"),
    (lambda p: open(p + ".bin", "ab").write(b"\0\0"), "do not belong together"),
    (lambda p: _patch(p + ".idx", 18, (10 ** 6).to_bytes(8, "little")), "index"),
    (lambda p: os.remove(p + ".idx"), "index file not found"),
    (lambda p: os.remove(p + ".bin"), "data file not found"),
])
def test_damaged_files_get_a_clear_error(fixtures_dir, tmp_path, damage, needle):
    prefix = _copy(fixtures_dir, tmp_path)
    damage(prefix)
    with pytest.raises(DataFileError) as err:
        IndexedDataset(prefix)
    assert isinstance(err.value, UserError)
    assert needle in str(err.value) and prefix in str(err.value)


def test_sequence_pointer_past_end_is_refused(fixtures_dir, tmp_path):
    prefix = _copy(fixtures_dir, tmp_path)
    ds = IndexedDataset(prefix)
    n = len(ds)
    del ds
    # Point the last sequence beyond the .bin while keeping every size consistent.
    _patch(prefix + ".idx", 34 + 4 * n + 8 * (n - 1), (10 ** 9).to_bytes(8, "little"))
    with pytest.raises(DataFileError, match="index points up to"):
        IndexedDataset(prefix)


def test_missing_prefix_names_the_prefix(tmp_path):
    with pytest.raises(DataFileError, match="_text_document"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_pickling_reopens_the_files(fixtures_dir):
    import pickle
    ds = IndexedDataset(os.path.join(fixtures_dir, "corpus_a"))
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the path, not the tokens
    again = pickle.loads(blob)
    assert np.array_equal(again[3], ds[3]) and len(again) == len(ds)
