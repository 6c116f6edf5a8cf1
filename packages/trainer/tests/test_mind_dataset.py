"""MindDataset loader: MindRecord files written with MindSpore's FileWriter train through the
Trainer, batch for batch, sharded by data-parallel rank and resumable."""

import os

import numpy as np
import pytest

from mindtrain.config import ConfigError, load_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
SEQ = 32
RECORDS = 8


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """(folder, token rows): RECORDS MindFormers-style records of SEQ + 1 tokens cut from
    the tiny tokenized corpus, in two .mindrecord files."""
    from mindspore.mindrecord import FileWriter

    from mindtrain.data import build_dataset
    from mindtrain.trainer.quickstart import prepare_data

    tmp = tmp_path_factory.mktemp("mindrecord")
    prefix = prepare_data(str(tmp / "pydoc"))
    cfg = load_config(TINY, [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}",
                             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']"])
    gpt = build_dataset(cfg.train_dataset)
    rows = [np.concatenate([s["input_ids"], s["labels"][-1:]]).astype(np.int32)
            for s in (gpt[i] for i in range(RECORDS))]
    folder = tmp / "records"
    folder.mkdir()
    for part, chunk in enumerate((rows[:5], rows[5:])):
        writer = FileWriter(str(folder / f"part{part}.mindrecord"), shard_num=1, overwrite=True)
        writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "pretrain")
        writer.write_raw_data([{"input_ids": r} for r in chunk])
        writer.commit()
    return str(folder), rows


def _cfg(files, tmp, *extra):
    import mindspore as ms

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    loader = f"{{type: MindDataset, dataset_files: '{files}', column_names: [input_ids], shuffle: false}}"
    return load_config(TINY, [f"model.seq_length={SEQ}", "model.num_hidden_layers=2", "training.steps=2",
                              "training.global_batch_size=2", "checkpoint.enable_save=false",
                              f"train_dataset.dataloader={loader}", f"monitor.metrics_dir={tmp}/metrics", *extra])


def test_trainer_trains_on_the_records_batch_for_batch(records, tmp_path):
    from mindtrain.trainer.runtime import Runtime
    from mindtrain.trainer.trainer import Trainer

    folder, rows = records
    lines = []
    trainer = Trainer(_cfg(folder, tmp_path), Runtime(device="CPU"), out=lines.append)
    seen = []
    run_step = trainer.layout.run_step

    def spy(batches):  # records what the layout is handed; the step itself runs unchanged
        seen.extend(batches)
        return run_step(batches)

    trainer.layout.run_step = spy
    history = trainer.train()
    assert [r["step"] for r in history] == [1, 2] and all(np.isfinite(r["loss"]) for r in history)
    assert len([x for x in lines if x.startswith("{ step:")]) == 2
    assert trainer.columns == ["input_ids", "labels", "loss_mask", "position_ids"]
    assert len(seen) == 4  # 2 steps x 2 micro-batches of 1 (global batch 2, one process)
    for i, batch in enumerate(seen):
        np.testing.assert_array_equal(batch["input_ids"][0], rows[i][:-1])
        np.testing.assert_array_equal(batch["labels"][0], rows[i][1:])
        np.testing.assert_array_equal(batch["loss_mask"][0], np.ones(SEQ, np.float32))
        np.testing.assert_array_equal(batch["position_ids"][0], np.arange(SEQ))


def test_sharded_by_dp_rank_and_resumes_in_place(records, tmp_path):
    from mindtrain.trainer.mind_dataset import build_mind_loader

    folder, rows = records
    cfg = _cfg(folder, tmp_path, "training.global_batch_size=4")
    rank1 = build_mind_loader(cfg, dp_rank=1, dp_size=2)
    first = [next(rank1)["input_ids"][0] for _ in range(2)]  # step 1: records 1 and 3
    for got, want in zip(first, (rows[1], rows[3])):
        np.testing.assert_array_equal(got, want[:-1])
    state = rank1.state_dict()
    resumed = build_mind_loader(cfg, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(next(resumed)["input_ids"][0], rows[5][:-1])  # step 2 starts at record 4
    rank1.close()
    resumed.close()


def test_mistakes_are_one_line(records, tmp_path):
    from mindtrain.trainer.mind_dataset import build_mind_loader

    folder, _ = records
    with pytest.raises(ConfigError, match=r"dataset_files: 'nope' does not exist"):
        build_mind_loader(_cfg("nope", tmp_path), 0, 1)
    with pytest.raises(ConfigError, match=r"column_names: \['labels'\] not in the MindRecord files"):
        build_mind_loader(_cfg(folder, tmp_path, "train_dataset.dataloader.column_names=[input_ids, labels]"), 0, 1)
    with pytest.raises(ConfigError, match=r"records need input_ids \(no labels column\) of 65 tokens"):
        build_mind_loader(_cfg(folder, tmp_path, "model.seq_length=64"), 0, 1)
    with pytest.raises(ConfigError, match=r"dataset_files: is required for MindDataset"):
        load_config(TINY, ["train_dataset.dataloader={type: MindDataset, column_names: [input_ids]}"])
