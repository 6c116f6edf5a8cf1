"""Context-parallel chunking, masks and loss shares (single process)."""

import numpy as np
import pytest

from mindtrain.config import ConfigError, UserError
from mindtrain.parallel.context_parallel import check_seq_length, chunk_indices, split_batch

# the model's own input rule (context parallelism only chunks what it returns)
from mindtrain.models.inputs import whole_sequence_inputs


def test_load_balanced_chunks_cover_the_sequence():
    idx = [chunk_indices(16, 2, r) for r in range(2)]
    assert idx[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert idx[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    allidx = np.concatenate([chunk_indices(24, 3, r) for r in range(3)])
    assert sorted(allidx.tolist()) == list(range(24))
    # causal work (keys visible to each query) is equal on every rank
    work = [int((chunk_indices(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1


def test_seq_length_not_divisible_is_one_line_user_error():
    with pytest.raises(ConfigError, match=r"model.seq_length.*divisible by 2 x context_parallel = 4") as e:
        check_seq_length(18, 2)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    check_seq_length(18, 1)


def test_split_batch_shares_sum_to_one_and_masks_rows():
    rng = np.random.default_rng(0)
    s = 16
    batch = {"input_ids": rng.integers(0, 50, (2, s)), "labels": rng.integers(0, 50, (2, s)),
             "loss_mask": (rng.random((2, s)) > 0.3).astype(np.float32),
             "attention_mask": np.array([[5, 16], [9, 16]])}
    parts = [split_batch(batch, 2, r, num_heads=3, mtp_depths=1, inputs=whole_sequence_inputs) for r in range(2)]
    mask_tokens = [p["loss_mask"].asnumpy().sum() for p in parts]
    total = batch["loss_mask"].sum()
    assert sum(p["lm_scale"] for p in parts) == pytest.approx(1.0)
    assert parts[0]["lm_scale"] == pytest.approx(mask_tokens[0] / total)
    assert sum(p["mtp"][0]["scale"] for p in parts) == pytest.approx(1.0)
    full = split_batch(batch, 1, 0, num_heads=3, inputs=whole_sequence_inputs)["mask_add"].asnumpy()
    for r, p in enumerate(parts):
        idx = chunk_indices(s, 2, r)
        assert p["mask_add"].shape == (2, 3, s // 2, s)
        np.testing.assert_array_equal(p["mask_add"].asnumpy(), full[:, :, idx, :])
        np.testing.assert_array_equal(p["input_ids"].asnumpy(), batch["input_ids"][:, idx])
        # MTP targets are shifted on the whole sequence, then chunked
        shifted = np.concatenate([batch["labels"][:, 1:], np.zeros((2, 1), int)], 1)
        np.testing.assert_array_equal(p["mtp"][0]["labels"].asnumpy(), shifted[:, idx])
