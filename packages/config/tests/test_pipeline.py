"""parallelism.pipeline_parallel_layers_per_stage in MindFormers' forms, with and without
interleaving, and one-line errors naming the field."""

import pytest

from mindtrain.config import ConfigError
from mindtrain.config.pipeline_layers import layer_counts


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
