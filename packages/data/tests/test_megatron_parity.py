"""Sample-for-sample parity with Megatron-Core 0.16 (fixtures from tools/make_megatron_fixtures.py)."""

import os

import numpy as np
import pytest

from mindtrain.data import BlendedDataset, GPTDataset, build_dataset

CASES = ["defaults_single", "defaults_weighted", "all_flags", "no_extra_token", "blend_03_07", "int32",
         "two_epochs_separate", "two_epochs_joined", "three_way_split"]


def _members(ds):
    return ds.datasets if isinstance(ds, BlendedDataset) else [ds]


@pytest.mark.parametrize("name", CASES)
def test_samples_and_indices_match_megatron(name, manifest, tmp_path, make_section, fixtures_dir):
    case = manifest["cases"][name]
    section = make_section(case, str(tmp_path / "cache"))
    for split, info in case["splits"].items():
        ref = np.load(os.path.join(fixtures_dir, info["file"]))
        ds = build_dataset(section, split=split)
        assert type(ds).__name__ == info["kind"]
        assert len(ds) == info["length"]
        if "dataset_index" in ref:
            np.testing.assert_array_equal(ds.dataset_index, ref["dataset_index"])
            np.testing.assert_array_equal(ds.dataset_sample_index, ref["dataset_sample_index"])
        for m, member in enumerate(_members(ds)):
            for key in ("document_index", "sample_index", "shuffle_index"):
                ours, theirs = np.asarray(getattr(member, key)), ref[f"m{m}_{key}"]
                assert ours.dtype == theirs.dtype, key
                np.testing.assert_array_equal(ours, theirs, err_msg=key)
        cols = section["dataloader"]["column_names"]
        n = info["recorded"]
        got = {c: np.stack([ds[i][c] for i in range(n)]) for c in cols}
        for c in ("input_ids", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(got[c], ref[c], err_msg=c)
        if "attention_mask" in cols:
            bits = np.packbits(got["attention_mask"].reshape(n, -1), axis=1)
            np.testing.assert_array_equal(bits, ref["attention_mask_bits"])


def test_two_epoch_cases_differ_in_final_epoch_rule(manifest, tmp_path, make_section):
    """The separate case keeps the final epoch's samples apart in the shuffle; the joined does not."""
    out = {}
    for name in ("two_epochs_separate", "two_epochs_joined"):
        ds = build_dataset(make_section(manifest["cases"][name], str(tmp_path / name)))
        sizes = ds.indexed.sequence_lengths
        per_epoch = (int(sizes.sum()) - 1) // ds.seq_length
        head = np.asarray(ds.shuffle_index[:per_epoch])
        out[name] = int(head.max()) < per_epoch
    assert out == {"two_epochs_separate": True, "two_epochs_joined": False}


def test_random_settings_match_megatron(manifest, fixtures_dir, tmp_path):
    """24 random settings (1-3 prefixes, weights, splits, epochs, empty documents, pad in data)."""
    ref = np.load(os.path.join(fixtures_dir, "random_cases.npz"))
    for k, case in enumerate(manifest["random_cases"]):
        cfg = dict(case["config"], path_to_cache=str(tmp_path / "cache"))
        cfg["data_path"] = [p if p.replace(".", "").isdigit() else os.path.join(fixtures_dir, p)
                            for p in cfg["data_path"]]
        section = {"dataloader": {"sizes": case["sizes"], "config": cfg}}
        for split, length in case["lengths"].items():
            ds = build_dataset(section, split=split)
            key = f"c{k}_{split}_"
            assert len(ds) == length, (k, split)
            if key + "dataset_index" in ref:
                np.testing.assert_array_equal(ds.dataset_index, ref[key + "dataset_index"])
                np.testing.assert_array_equal(ds.dataset_sample_index, ref[key + "dataset_sample_index"])
            for j, i in enumerate(ref[key + "idx"]):
                sample = ds[int(i)]
                for col in ("input_ids", "labels", "loss_mask", "position_ids"):
                    np.testing.assert_array_equal(sample[col], ref[key + col][j], err_msg=f"case {k} {split} {col}")


def test_split_without_tokens_is_a_user_error(manifest, make_section, tmp_path):
    """Megatron-Core loops forever here; we stop with a message."""
    from mindtrain.config import UserError
    section = make_section(manifest["cases"]["defaults_single"], str(tmp_path))
    section["dataloader"]["config"]["split"] = "1000, 1, 0"
    with pytest.raises(UserError, match="too few for one sample"):
        build_dataset(section, split="valid")
