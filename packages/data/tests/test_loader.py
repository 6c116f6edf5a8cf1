"""PretrainingLoader: Megatron sampler order per data-parallel rank, prefetch, exact resume."""

import numpy as np
import pytest

from mindtrain.config import ConfigError
from mindtrain.data import PretrainingLoader, build_dataset, build_loader


@pytest.fixture(scope="module")
def dataset(manifest, make_section, tmp_path_factory):
    section = make_section(manifest["cases"]["defaults_single"], str(tmp_path_factory.mktemp("cache")))
    return build_dataset(section)


def _sample_ids(dataset, batch, _tables={}):
    """Which dataset samples a micro-batch holds (by matching input_ids rows)."""
    if id(dataset) not in _tables:
        _tables[id(dataset)] = {dataset[i]["input_ids"].tobytes(): i for i in range(len(dataset))}
    table = _tables[id(dataset)]
    return [table[row.tobytes()] for row in batch["input_ids"]]


def test_megatron_sampler_order_across_ranks(dataset):
    mbs, gbs, dp = 2, 12, 3
    loaders = [PretrainingLoader(dataset, mbs, gbs, r, dp) for r in range(dp)]
    per_step = gbs // (mbs * dp)
    assert all(l.micro_batches_per_step == per_step == 2 for l in loaders)
    for step in range(3):
        for m in range(per_step):
            group_start = step * gbs + m * mbs * dp
            for r, loader in enumerate(loaders):
                batch = next(loader)
                assert batch["input_ids"].shape == (mbs, dataset.seq_length)
                assert batch["input_ids"].dtype == np.int32
                expect = list(range(group_start + r * mbs, group_start + (r + 1) * mbs))
                for row, i in zip(batch["input_ids"], expect):
                    np.testing.assert_array_equal(row, dataset[i]["input_ids"])


def test_drop_remainder_and_epoch_end(dataset):
    n = len(dataset)
    loader = PretrainingLoader(dataset, 4, 8, 0, 1, repeat=False)
    assert len(list(loader)) == (n // 8) * 2 == len(loader)
    keep = PretrainingLoader(dataset, 4, 8, 0, 1, drop_remainder=False, repeat=False)
    batches = list(keep)
    assert sum(b["input_ids"].shape[0] for b in batches) == n


@pytest.mark.parametrize("workers,shuffle", [(0, False), (2, False), (2, True)])
def test_resume_continues_at_the_exact_next_sample(dataset, workers, shuffle):
    kw = dict(micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2, num_workers=workers,
              shuffle=shuffle, seed=5, repeat=True)
    straight = PretrainingLoader(dataset, **kw)
    expected = [next(straight)["input_ids"] for _ in range(300)]  # crosses an epoch boundary
    first = PretrainingLoader(dataset, **kw)
    for _ in range(137):
        next(first)
    state = first.state_dict()
    first.close()
    resumed = PretrainingLoader(dataset, **kw)
    resumed.load_state_dict(state)
    for k in range(137, 300):
        np.testing.assert_array_equal(next(resumed)["input_ids"], expected[k])


def test_consumed_samples_alone_counts_over_epochs(dataset):
    kw = dict(micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2, shuffle=True, seed=3)
    a = PretrainingLoader(dataset, **kw)
    for _ in range(100):
        next(a)
    state = a.state_dict()
    assert state["epoch"] == 1
    b = PretrainingLoader(dataset, **kw)
    per_epoch = (len(dataset) // 8) * 8
    b.load_state_dict({"consumed_samples": state["epoch"] * per_epoch + state["consumed_samples"]})
    np.testing.assert_array_equal(next(a)["input_ids"], next(b)["input_ids"])


def test_start_step_skips_whole_global_batches(dataset):
    a = PretrainingLoader(dataset, 2, 8, 0, 2)
    for _ in range(2 * 3):
        next(a)
    b = PretrainingLoader(dataset, 2, 8, 0, 2, start_step=3)
    np.testing.assert_array_equal(next(a)["input_ids"], next(b)["input_ids"])


def test_shuffle_is_deterministic_by_seed_and_epoch(dataset):
    def order(seed, epochs=1):
        l = PretrainingLoader(dataset, 4, 4, shuffle=True, seed=seed, repeat=True)
        return [i for _ in range(epochs * len(l)) for i in _sample_ids(dataset, next(l))]
    per_epoch = (len(dataset) // 4) * 4
    o1, o2, o3 = order(1, 2), order(1, 2), order(2)
    assert o1 == o2 and o1[:per_epoch] != o3
    assert o1[:per_epoch] != list(range(per_epoch))
    assert o1[:per_epoch] != o1[per_epoch:]  # a new permutation each epoch
    assert len(set(o1[:per_epoch])) == per_epoch


def test_bad_batch_sizes_are_user_errors(dataset):
    with pytest.raises(ConfigError, match="global_batch_size"):
        PretrainingLoader(dataset, 2, 6, 0, 2)
    with pytest.raises(ConfigError, match="sizes"):
        PretrainingLoader(dataset, 1, 10 ** 6)


def test_build_loader_reads_the_section(dataset):
    section = {"dataloader": {"shuffle": True}, "drop_remainder": False, "num_parallel_workers": 3}
    loader = build_loader(section, dataset, 2, 4, seed=9)
    assert (loader.shuffle, loader.drop_remainder, loader.num_workers, loader.seed) == (True, False, 3, 9)
    loader.close()
