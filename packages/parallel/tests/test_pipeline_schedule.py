"""Pipeline schedules and stage partitioning (plain data, no MindSpore)."""

import pytest

from mindtrain.config import ConfigError
from mindtrain.parallel.pipeline_schedule import bubble_fraction, stage_ops
from mindtrain.parallel.pipeline_stage import partition_units


def _units(layers: int, mtp: int = 1) -> list[dict]:
    units = [{"name": "embedding", "kind": "embedding"}]
    units += [{"name": f"layers.{i}", "kind": "decoder"} for i in range(layers)]
    units.append({"name": "head", "kind": "head"})
    units += [{"name": f"mtp.{k}", "kind": "mtp"} for k in range(mtp)]
    return units


def test_1f1b_warmup_steady_cooldown():
    assert stage_ops("1f1b", 2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert stage_ops("1f1b", 2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    # fewer micro-batches than warm-up slots
    assert stage_ops("1f1b", 4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_gpipe_all_forwards_first():
    assert stage_ops("GPipe", 3, 1, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 5), (3, 4), (4, 8)])
def test_every_micro_batch_once_and_forward_before_backward(kind, stages, m):
    for s in range(stages):
        ops = stage_ops(kind, stages, s, m)
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
        # in flight: forwards not yet backwarded never exceed the 1F1B bound
        if kind == "1f1b":
            live = peak = 0
            for k, _ in ops:
                live += 1 if k == "F" else -1
                peak = max(peak, live)
            assert peak <= stages - s


def test_unknown_schedule_names_the_field():
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule"):
        stage_ops("zero-bubble", 2, 0, 2)


def test_bubble_fraction():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(1, 8) == 0.0


def test_partition_balanced_by_layer_count():
    parts = partition_units(_units(3), 2)
    assert parts == [["embedding", "layers.0", "layers.1"], ["layers.2", "head", "mtp.0"]]
    parts = partition_units(_units(4, mtp=0), 3)
    assert parts == [["embedding", "layers.0", "layers.1"], ["layers.2"], ["layers.3", "head"]]


def test_partition_explicit_layers_per_stage():
    parts = partition_units(_units(3), 2, [1, 2])
    assert parts == [["embedding", "layers.0"], ["layers.1", "layers.2", "head", "mtp.0"]]


@pytest.mark.parametrize("per_stage", [[1, 1], [2, 2], [3], [4, -1]])
def test_partition_bad_layers_per_stage(per_stage):
    with pytest.raises(ConfigError, match="pipeline_parallel_layers_per_stage"):
        partition_units(_units(3), 2, per_stage)


def test_partition_too_many_stages():
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        partition_units(_units(2), 4)


def test_unknown_dp_sharding_names_the_field():
    from mindtrain.parallel.pipeline_parallel import PipelineSchedule

    # checked before the model or mesh is touched
    with pytest.raises(ConfigError, match="data_parallel_shard_strategy.*optim_grads_params"):
        PipelineSchedule(None, {}, None, 16, dp_sharding="zero3")
