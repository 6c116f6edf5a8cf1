"""The model's numpy input rules (models.inputs): one copy, used by the model's mask and by
context parallelism's split."""

import numpy as np
import pytest
from mindspore import Tensor

from mindtrain.config import ConfigError
from mindtrain.models.attention_mask import additive_mask
from mindtrain.models.inputs import NEG, blocked_matrix, shift_left, whole_sequence_inputs


def test_blocked_matrix_documents_and_causality():
    ends = np.array([[3, 6, 6, 6]])  # documents [0,3) [3,6); pad = S
    blocked = blocked_matrix(ends, 1, 6)[0]
    allowed = ~blocked
    assert allowed[4].tolist() == [False, False, False, True, True, False]
    assert allowed[2].tolist() == [True, True, True, False, False, False]
    full = np.zeros((1, 1, 6, 6), bool)
    full[0, 0, 5, 0] = True  # an explicit Megatron mask (True = masked)
    b = blocked_matrix(full, 1, 6)[0]
    assert b[5, 0] and not b[5, 1] and b[0, 1]
    with pytest.raises(ConfigError, match=r"^attention_mask: expected \[B, 1, 6, 6\]"):
        blocked_matrix(np.zeros((1, 1, 5, 5), bool), 1, 6)


def test_additive_mask_tensor_is_the_numpy_rule():
    ends = np.array([[3, 6, 6], [2, 4, 6]], np.int32)
    got = additive_mask(Tensor(ends), 2, 6, 3).asnumpy()
    assert got.shape == (2, 3, 6, 6) and got.dtype == np.float32
    want = np.where(blocked_matrix(ends, 2, 6), np.float32(NEG), np.float32(0))
    for head in range(3):
        np.testing.assert_array_equal(got[:, head], want)
    causal = additive_mask(None, 2, 6, 1).asnumpy()
    np.testing.assert_array_equal(causal[0, 0] != 0, np.triu(np.ones((6, 6), bool), 1))


def test_shift_left_and_whole_sequence_inputs():
    x = np.arange(10).reshape(2, 5)
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]]
    batch = {"input_ids": x, "labels": x + 1}
    w = whole_sequence_inputs(batch, 2)
    assert w["loss_mask"].tolist() == np.ones((2, 5)).tolist()
    assert w["position_ids"].tolist() == [list(range(5))] * 2
    assert w["mask_add"].shape == (2, 1, 5, 5)
    assert [d["labels"].tolist() for d in w["mtp"]] == [shift_left(x + 1, 1).tolist(), shift_left(x + 1, 2).tolist()]
    assert w["mtp"][1]["loss_mask"][:, -2:].sum() == 0
