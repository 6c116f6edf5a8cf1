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


def _ulysses_step(order: str):
    """Loss, gradients and max attention logits of one forward + backward of the tiny
    DeepSeek-V3 (eager, 16 tokens) with the attention core under a one-rank Ulysses wrapper
    and recomputed (``order``: "recompute_first", the trainer's, or "ulysses_first"), or
    neither ("plain")."""
    import os

    import mindspore as ms
    from mindspore import Tensor

    from mindtrain.config import RecomputePlan, load_config
    from mindtrain.models import apply_recompute, build_model
    from mindtrain.models.attention import max_attention_logits, track_max_attention_logits
    from mindtrain.parallel.context_parallel import _HeadExchange, install_ulysses
    from mindtrain.parallel.mesh import Group

    ms.set_device("CPU")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    cfg = load_config(os.path.join(root, "configs", "pynative_ds3_tiny.yaml"),
                      ["model.seq_length=16", "train_dataset.dataloader.config.seq_length=16",
                       "model.num_hidden_layers=2", "model.num_nextn_predict_layers=0"], validate=False)
    ms.set_seed(3)
    np.random.seed(3)
    model = build_model(cfg.model, jit=False)
    track_max_attention_logits(model)
    cores = [layer.self_attn.core_attention for layer in model.model.layers]
    for core in cores:
        core.row_block_elements = 64  # blocks of 4 query rows of 16 keys
    one = Group("cp", (0,), 0, None)  # a one-rank group: the exchange moves nothing, the wiring is real

    def recompute():  # layer 0 whole, the core alone in layer 1
        apply_recompute(model, RecomputePlan(full=(0,), select={"self_attn.core_attention": (1,)}))

    if order == "recompute_first":
        recompute()
    wrappers = [install_ulysses(core, _HeadExchange(one), 16) for core in cores] if order != "plain" else []
    if order == "ulysses_first":
        recompute()
    rng = np.random.default_rng(5)
    tok = rng.integers(2, 500, size=(1, 17)).astype(np.int32)
    ids, labels = Tensor(tok[:, :-1]), Tensor(tok[:, 1:])
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda: model(ids, labels=labels)[0], None, params)()
    logits = max_attention_logits(model)
    inner = [w.inner == core._row_blocks for w, core in zip(wrappers, cores)]  # pylint: disable=protected-access
    return float(loss.asnumpy()), [g.asnumpy() for g in grads], logits, inner, model


@pytest.fixture(scope="module")
def plain_step():
    return _ulysses_step("plain")


@pytest.mark.parametrize("order", ["recompute_first", "ulysses_first"])
def test_ulysses_with_recomputed_core_and_max_logits_equals_plain(plain_step, order):
    """Issue 34: a recomputed attention core (row blocks) runs inside the Ulysses wrapper in
    either order of recompute and layout, and the wrapper reports the max logits through the
    core's ``head_max_eager``; loss, gradients and per-head maxima equal the plain model's.
    The exchange over more than one rank: integration_tests/test_cp_pp_parity.py."""
    loss0, grads0, logits0, _, _ = plain_step
    loss, grads, logits, inner, model = _ulysses_step(order)
    assert inner == [True, True]  # each wrapper runs its core's row blocks
    assert sum(w.forward_calls for w in model.recompute_wrappers.values()) == 4  # first pass + replay, twice
    assert abs(loss - loss0) <= 1e-6 * abs(loss0)
    for g, g0 in zip(grads, grads0):
        assert np.abs(g - g0).max() <= 1e-5 * max(np.abs(g0).max(), 1e-30)
    assert sorted(logits) == sorted(logits0) == [0, 1]
    for i in logits0:
        assert logits[i].shape == (4,) and np.allclose(logits[i], logits0[i], rtol=1e-6, atol=0)
