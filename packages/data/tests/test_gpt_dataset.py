"""Masks, the compressed EOD mask, the on-disk index cache and dataset config errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindtrain.config import ConfigError, UserError
from mindtrain.data import BlendedDataset, build_dataset, compressed_eod_mask, ltor_masks_and_position_ids
from mindtrain.data.gpt_dataset import build_sample_index


def test_masks_by_hand():
    tokens = np.array([3, 1, 4, 5, 1, 6])
    att, loss, pos = ltor_masks_and_position_ids(tokens, 1, True, True, True, True)
    assert pos.tolist() == [0, 1, 0, 1, 2, 0]
    assert loss.tolist() == [1, 0, 1, 1, 0, 1]
    allowed = ~att[0]
    assert allowed[3].tolist() == [False, False, True, True, False, False]
    assert allowed[5].tolist() == [False] * 5 + [True]
    att, loss, pos = ltor_masks_and_position_ids(tokens, 1, False, False, False, True)
    assert pos.tolist() == list(range(6)) and loss.tolist() == [1] * 6
    assert np.array_equal(~att[0], np.tri(6, dtype=bool))


def test_compressed_eod_mask_by_hand():
    assert compressed_eod_mask(np.array([5, 1, 7, 8, 1, 9, 1]), 1, 4).tolist() == [2, 5, 7, 7]
    assert compressed_eod_mask(np.array([5, 1, 7]), 1, 3).tolist() == [2, 3, 3]
    assert compressed_eod_mask(np.array([5, 6, 7]), 1, 2).tolist() == [3, 3]
    with pytest.raises(UserError, match="eod_pad_length"):
        compressed_eod_mask(np.array([1, 1, 1, 5]), 1, 2)


def test_sample_index_edge_cases_match_megatron_helper():
    # Expected rows were printed by megatron-core 0.16.1's compiled helpers.build_sample_idx.
    cases = [((0, [4, 4], True), [[0, 0], [0, 4], [1, 4]]),
             ((0, [4, 0, 4], True), [[0, 0], [0, 4], [2, 4]]),
             ((0, [3, 5, 2], False), [[0, 0], [1, 1], [1, 5], [2, 2]]),
             ((1, [4, 4], True), [[0, 0], [1, 0]]),
             ((1, [4, 4], False), [[0, 0], [1, 0], [1, 3]]),
             ((1, [4, 0, 4], False), [[0, 0], [2, 0], [2, 3]])]
    for (extra, sizes, drop), rows in cases:
        s = np.array(sizes, np.int32)
        out = build_sample_index(s, np.arange(len(s), dtype=np.int32), 4, 1, int(s.sum()), drop, extra)
        assert out.tolist() == rows, (extra, sizes, drop)


def _section(manifest, make_section, cache, **config):
    section = make_section(manifest["cases"]["defaults_weighted"], cache)
    section["dataloader"]["config"].update(config)
    return section


def test_compressed_eod_column(manifest, make_section, tmp_path):
    section = _section(manifest, make_section, str(tmp_path), create_compressed_eod_mask=True, eod_pad_length=16)
    section["dataloader"]["column_names"].append("attention_mask")
    ds = build_dataset(section)
    for i in range(0, len(ds), 7):
        s = ds[i]
        ends = s["attention_mask"]
        assert ends.dtype == np.int32 and ends.shape == (16,)
        real = ends[ends < 32]
        assert np.all(np.diff(real) > 0) and np.all(s["input_ids"][real - 1] == 1)
        assert len(real) == int(np.sum(s["input_ids"][:-1] == 1))


def _build_in_subprocess(section_json):
    code = ("import json,sys; from mindtrain.data import build_dataset; "
            "ds = build_dataset(json.loads(sys.argv[1])); m = ds.datasets[0]; "
            "print(json.dumps([bool(m.built_indices), bool(ds.built_indices), len(ds)]))")
    return subprocess.Popen([sys.executable, "-c", code, section_json], stdout=subprocess.PIPE, text=True)


def test_index_cache_built_once_then_reused(manifest, make_section, tmp_path):
    cache = str(tmp_path / "cache")
    section = json.dumps(_section(manifest, make_section, cache))
    procs = [_build_in_subprocess(section) for _ in range(3)]
    results = [json.loads(p.communicate()[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(r[0] for r in results) == 1 and sum(r[1] for r in results) == 1  # one builder, others waited
    assert len({r[2] for r in results}) == 1
    again = json.loads(_build_in_subprocess(section).communicate()[0])
    assert again[:2] == [False, False]
    files = os.listdir(cache)
    assert not [f for f in files if f.startswith(".tmp")]
    assert sum(f.endswith("description.txt") for f in files) == 2
    # Anything that changes the indices gets its own entry; mask flags do not.
    build_dataset(_section(manifest, make_section, cache, seed=4321))
    build_dataset(_section(manifest, make_section, cache, eod_mask_loss=True))
    assert sum(f.endswith("description.txt") for f in os.listdir(cache)) == 3


def test_cached_and_fresh_samples_agree(manifest, make_section, tmp_path):
    section = _section(manifest, make_section, str(tmp_path))
    a, b = build_dataset(section), build_dataset(section)
    assert a.datasets[0].built_indices and not b.datasets[0].built_indices
    for i in (0, 5, len(a) - 1):
        assert all(np.array_equal(a[i][k], b[i][k]) for k in a[i])


@pytest.mark.parametrize("change,needle", [
    (lambda c: c.update(split=None), "split"),
    (lambda c: c.update(data_path=[]), "data_path"),
    (lambda c: c.update(data_path=["1", "p", "2"]), "data_path"),
    (lambda c: c.update(split="0, 1, 0"), "train split"),
    (lambda c: c.update(create_attention_mask=True), "column_names"),
    (lambda c: c.update(bogus=1), "bogus"),
])
def test_config_mistakes_are_one_line_errors(manifest, make_section, tmp_path, change, needle):
    section = _section(manifest, make_section, str(tmp_path))
    change(section["dataloader"]["config"])
    with pytest.raises(ConfigError, match=needle):
        build_dataset(section)


def test_equal_blend_alternates_and_oversampling_is_a_user_error(manifest, make_section, tmp_path):
    section = _section(manifest, make_section, str(tmp_path))
    section["dataloader"]["config"]["data_path"] = [
        "0.5", section["dataloader"]["config"]["data_path"][1]] * 2
    ds = build_dataset(section)
    assert len(ds) == 150 and ds.dataset_index.tolist()[:6] == [0, 1, 0, 1, 0, 1]
    member = ds.datasets[0]
    with pytest.raises(UserError, match="lower sizes"):
        BlendedDataset([member, member], [0.5, 0.5], 2 * len(member) + 2, str(tmp_path))


def test_data_package_imports_without_mindspore():
    code = ("import sys, mindtrain.data, mindtrain.data.cli, mindtrain.data.preprocess; "
            "assert 'mindspore' not in sys.modules, 'mindspore imported'")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
