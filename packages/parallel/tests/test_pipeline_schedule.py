"""Pipeline schedules and stage partitioning (plain data, no MindSpore).

The interleaved (virtual-pipeline) schedule is checked by running every rank's op list
against the others in pure Python: a receive blocks until its message was sent (sends never
block, as ``isend`` in the pipeline), so a schedule that could deadlock stops early."""

import pytest

from mindtrain.config import ConfigError
from mindtrain.parallel.pipeline_schedule import (
    Op,
    bubble_fraction,
    op_messages,
    resolve_schedule,
    sent_messages,
    stage_ops,
)
from mindtrain.config.pipeline import partition_units


def _units(layers: int, mtp: int = 1) -> list[dict]:
    units = [{"name": "embedding", "kind": "embedding"}]
    units += [{"name": f"layers.{i}", "kind": "decoder"} for i in range(layers)]
    units.append({"name": "head", "kind": "head"})
    units += [{"name": f"mtp.{k}", "kind": "mtp"} for k in range(mtp)]
    return units


def _pairs(ops):
    assert all(op.chunk == 0 for op in ops)
    return [(op.kind, op.micro) for op in ops]


def test_1f1b_warmup_steady_cooldown():
    assert _pairs(stage_ops("1f1b", 2, 0, 3)) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert _pairs(stage_ops("1f1b", 2, 1, 3)) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    # fewer micro-batches than warm-up slots
    assert _pairs(stage_ops("1f1b", 4, 0, 2)) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_gpipe_all_forwards_first():
    assert _pairs(stage_ops("GPipe", 3, 1, 2)) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_interleaved_order_two_stages_two_chunks():
    # Megatron's virtual pipeline: forwards over chunk 0 then chunk 1 in groups of P
    # micro-batches, backwards from the last chunk down; rank 0 warms up 2(P-1) + (V-1)P = 4
    F, B = (lambda i, c: Op("F", i, c)), (lambda i, c: Op("B", i, c))
    assert stage_ops("interleaved_1f1b", 2, 0, 4, chunks=2) == [
        F(0, 0), F(1, 0), F(0, 1), F(1, 1),
        F(2, 0), B(0, 1), F(3, 0), B(1, 1), F(2, 1), B(0, 0), F(3, 1), B(1, 0),
        B(2, 1), B(3, 1), B(2, 0), B(3, 0)]
    assert stage_ops("interleaved_1f1b", 2, 1, 4, chunks=2) == [
        F(0, 0), F(1, 0),
        F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 0), B(0, 0), F(3, 0), B(1, 0),
        F(2, 1), B(2, 1), F(3, 1), B(3, 1),
        B(2, 0), B(3, 0)]


def _run_pipeline(kind, stages, m, chunks):
    """Every rank's ops in turn, a receive waiting for its message: returns the executed
    count per rank and the order each rank received its messages."""
    ops = [stage_ops(kind, stages, r, m, chunks) for r in range(stages)]
    pos, sent, received = [0] * stages, set(), [[] for _ in range(stages)]
    progress = True
    while progress:
        progress = False
        for r in range(stages):
            while pos[r] < len(ops[r]):
                recv, send = op_messages(ops[r][pos[r]], r, stages, chunks)
                if recv is not None:
                    if recv[1] not in sent:
                        break
                    received[r].append(recv)
                if send is not None:
                    assert send[1] not in sent
                    sent.add(send[1])
                pos[r] += 1
                progress = True
    return ops, pos, received


@pytest.mark.parametrize("kind,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2),
                                         ("interleaved_1f1b", 3)])
@pytest.mark.parametrize("stages,groups", [(2, 1), (2, 3), (3, 2), (4, 1), (4, 3)])
def test_schedule_runs_without_deadlock_and_messages_pair_up(kind, chunks, stages, groups):
    m = stages * groups
    ops, pos, received = _run_pipeline(kind, stages, m, chunks)
    # no deadlock: every rank got through all its ops
    assert pos == [len(o) for o in ops]
    for r in range(stages):
        # each rank takes from each peer exactly the messages that peer sends it, in the
        # order it sends them (point-to-point messages between two ranks arrive in order)
        for src in range(stages):
            got = [msg for peer, msg in received[r] if peer == src]
            assert got == list(sent_messages(kind, stages, src, r, m, chunks)), (r, src)
        # every micro-batch's forward and backward through every chunk once, forward first
        assert sorted(ops[r]) == sorted(Op(k, i, c) for k in "FB" for i in range(m) for c in range(chunks))
        assert all(ops[r].index(Op("F", i, c)) < ops[r].index(Op("B", i, c)) for i in range(m) for c in range(chunks))
    # a forward message reaches every virtual stage once per micro-batch, and a gradient too
    assert sum(len(x) for x in received) == 2 * m * (stages * chunks - 1)


def test_interleaved_in_flight_bound():
    # at most 2(P-s-1) + (V-1)P + 1 chunk forwards wait for their backward on stage s
    for s in range(4):
        live = peak = 0
        for op in stage_ops("interleaved_1f1b", 4, s, 8, chunks=2):
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(2 * (4 - s - 1) + 4 + 1, 16)


def test_interleave_schedule_choice():
    # MindFormers: 1f1b with more than one chunk runs interleaved 1F1B
    assert resolve_schedule("1f1b", 2) == "interleaved_1f1b"
    assert resolve_schedule("1F1B", 1) == "1f1b"
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule: interleaved_1f1b needs pipeline_parallel_interleave_num > 1"):
        stage_ops("interleaved_1f1b", 2, 0, 2)
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule: gpipe runs one model chunk"):
        stage_ops("gpipe", 2, 0, 2, chunks=2)
    with pytest.raises(ConfigError, match="pipeline_parallel_interleave_num: must be an integer >= 1"):
        stage_ops("1f1b", 2, 0, 2, chunks=0)


def test_interleaved_needs_micro_batches_multiple_of_stages():
    with pytest.raises(ConfigError, match="training.global_batch_size: .* = 3.*multiple of pipeline_parallel"):
        stage_ops("interleaved_1f1b", 2, 0, 3, chunks=2)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 5), (3, 4), (4, 8)])
def test_every_micro_batch_once_and_forward_before_backward(kind, stages, m):
    for s in range(stages):
        ops = _pairs(stage_ops(kind, stages, s, m))
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
    # interleaving: (P-1) / (V M + P-1)
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)


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


@pytest.mark.parametrize("form", ["auto", None, [2, 2, 2, 2], [[2, 2], [2, 2]], ["0-1,4-5", "2-3,6-7"]])
def test_partition_interleaved_chunks(form):
    # 2 stages x 2 chunks: rank 0 runs layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7
    parts = partition_units(_units(8), 2, form, chunks=2)
    assert parts == [["embedding", "layers.0", "layers.1"], ["layers.2", "layers.3"],
                     ["layers.4", "layers.5"], ["layers.6", "layers.7", "head", "mtp.0"]]


def test_partition_interleaved_uneven():
    # the tiny model's 3 layers over 2 x 2 virtual stages: the last holds only head and MTP
    assert partition_units(_units(3), 2, None, chunks=2) == [
        ["embedding", "layers.0"], ["layers.1"], ["layers.2"], ["head", "mtp.0"]]
    # MindFormers' string form without interleaving: one range per stage
    assert partition_units(_units(3), 2, ["0", "1-2"]) == [
        ["embedding", "layers.0"], ["layers.1", "layers.2", "head", "mtp.0"]]


def test_partition_too_many_stages():
    with pytest.raises(ConfigError, match="pipeline_parallel"):
        partition_units(_units(2), 4)


def test_unknown_dp_sharding_names_the_field():
    from mindtrain.parallel.pipeline_parallel import PipelineSchedule

    # checked before the model or mesh is touched
    with pytest.raises(ConfigError, match="data_parallel_shard_strategy.*optim_grads_params"):
        PipelineSchedule(None, {}, None, 16, dp_sharding="zero3")
