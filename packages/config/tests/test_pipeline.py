"""parallelism.pipeline_parallel_layers_per_stage in MindFormers' forms, with and without
interleaving, and one-line errors naming the field."""

import pytest

from mindtrain.config import ConfigError
from mindtrain.config.pipeline import layer_counts, microbatch_note, resolve_schedule


@pytest.mark.parametrize("value", [None, "auto"])
def test_balanced(value):
    assert layer_counts(value, 8, 2, 2) is None


def test_forms_give_counts_per_virtual_stage():
    # chunk c of stage r is virtual stage c * P + r
    assert layer_counts(["0-2,5-5", "3-4,6-7"], 8, 2, 2) == [3, 2, 1, 2]
    assert layer_counts(["0-2,5", "3-4,6-7"], 8, 2, 2) == [3, 2, 1, 2]
    assert layer_counts([[3, 1], [2, 2]], 8, 2, 2) == [3, 2, 1, 2]
    assert layer_counts([3, 2, 1, 2], 8, 2, 2) == [3, 2, 1, 2]
    assert layer_counts([1, 2], 3, 2) == [1, 2]
    assert layer_counts(["0", "1-2"], 3, 2) == [1, 2]
    # the first and last virtual stage may hold only the embedding / the head and MTP
    assert layer_counts([0, 3], 3, 2) == [0, 3]
    assert layer_counts([[1, 1], [1, 0]], 3, 2, 2) == [1, 1, 1, 0]


@pytest.mark.parametrize("value,stages,chunks,message", [
    ("0-3", 2, 1, "must be \"auto\", null or a list"),
    ([1, 1], 2, 1, "sum to model.num_hidden_layers \\(3\\)"),
    ([3], 2, 1, "one entry per virtual stage .* = 2\\), got 1"),
    ([4, -1], 2, 1, ">= 0"),
    ([True, 2], 2, 1, "a list of ints, of lists of ints or of strings"),
    ([1, 0, 2], 3, 1, "only the first and last virtual stage may have no decoder layer"),
    ([[1, 1], [1]], 2, 2, "2 lists \\(one per pipeline stage\\) of 2 layer counts"),
    (["0-1", "2"], 2, 2, "stage 0 \\('0-1'\\) has 1 comma-separated range\\(s\\); pipeline_parallel_interleave_num is 2"),
    (["0", "1", "2"], 2, 1, "needs one string per pipeline stage \\(2\\), got 3"),
    (["0", "2"], 2, 1, "virtual stage 1 \\(stage 1, chunk 0\\) starts at layer 2; it must start at 1"),
    (["0", "1"], 2, 1, "the ranges end at layer 1; model.num_hidden_layers is 3"),
    (["0-x", "1-2"], 2, 1, "'0-x' is not a layer range"),
    (["1-0", "1-2"], 2, 1, "ends before it starts"),
    (["0", "1-2-3"], 2, 1, "'1-2-3' is not a layer range"),
])
def test_bad_values_name_the_field(value, stages, chunks, message):
    with pytest.raises(ConfigError, match=f"^parallelism.pipeline_parallel_layers_per_stage: .*{message}") as err:
        layer_counts(value, 3, stages, chunks)
    assert "\n" not in str(err.value)


def test_too_many_virtual_stages_for_balanced():
    with pytest.raises(ConfigError, match="^parallelism.pipeline_parallel: 2 stages x 3 chunks"):
        layer_counts("auto", 3, 2, 3)


def _parse(parallelism_yaml: str, overrides=(), world_size=2):
    import copy
    import os

    import yaml

    from mindtrain.config import parse_config

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    raw = copy.deepcopy(yaml.safe_load(open(os.path.join(root, "configs", "pynative_ds3_tiny.yaml"))))
    raw["parallelism"].update(yaml.safe_load(parallelism_yaml))
    return parse_config(raw, ["model.num_hidden_layers=4", *overrides], world_size=world_size)


MINDFORMERS_PP = """
pipeline_parallel: 2
pipeline_parallel_schedule: "1f1b"
pipeline_parallel_microbatch_size: 1
pipeline_parallel_interleave_num: 2
pipeline_parallel_layers_per_stage: ["0,2", "1,3"]
"""


def test_mindformers_pipeline_section_loads():
    p = _parse(MINDFORMERS_PP).parallelism
    assert resolve_schedule(p.pipeline_parallel_schedule, p.pipeline_parallel_interleave_num) == "interleaved_1f1b"
    assert layer_counts(p.pipeline_parallel_layers_per_stage, 4, 2, 2) == [1, 1, 1, 1]


@pytest.mark.parametrize("extra,overrides,message", [
    ("", ["training.global_batch_size=3"],
     "training.global_batch_size: interleaved_1f1b needs the micro-batches per step .* = 3\\) to be a multiple"),
    ("pipeline_parallel: 1\npipeline_parallel_layers_per_stage: auto", [],
     "parallelism.pipeline_parallel_interleave_num: 2 chunks need pipeline_parallel > 1"),
    ("pipeline_parallel_interleave_num: 1\npipeline_parallel_schedule: interleaved_1f1b\n"
     "pipeline_parallel_layers_per_stage: null", [],
     "parallelism.pipeline_parallel_schedule: interleaved_1f1b needs pipeline_parallel_interleave_num > 1"),
    ("pipeline_parallel_schedule: gpipe", [], "parallelism.pipeline_parallel_schedule: gpipe runs one model chunk"),
    ("pipeline_parallel_microbatch_size: 0", [], "parallelism.pipeline_parallel_microbatch_size: must be an integer >= 1"),
    ("pipeline_parallel_layers_per_stage: ['0,1', '2,3']", [], "parallelism.pipeline_parallel_layers_per_stage: "
                                                               "virtual stage 1 .* starts at layer 2"),
])
def test_pipeline_section_mistakes(extra, overrides, message):
    import yaml

    section = yaml.safe_load(MINDFORMERS_PP)
    section.update(yaml.safe_load(extra) or {})
    with pytest.raises(ConfigError, match=f"^{message}") as err:
        _parse(yaml.safe_dump(section), overrides)
    assert "\n" not in str(err.value)


def test_microbatch_size_is_the_micro_batch_count():
    # MindFormers' trainer sets it to global_batch_size / (dp x local_batch_size); so does mindtrain
    assert microbatch_note(4, 2, 4) is None
    assert microbatch_note(1, 1, 4) is None  # no pipeline: nothing to say
    assert microbatch_note(1, 2, 4) == (
        "parallelism.pipeline_parallel_microbatch_size: 1 is replaced by 4, the micro-batches per step "
        "(global_batch_size / (data parallel x local_batch_size)), as MindFormers does")
    with pytest.raises(ConfigError, match="^parallelism.pipeline_parallel_microbatch_size: must be an integer >= 1"):
        microbatch_note(True, 2, 4)
