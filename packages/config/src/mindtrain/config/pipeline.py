"""The pipeline fields of ``parallelism`` with MindFormers' meaning, as plain values.

``pipeline_parallel_layers_per_stage`` in every form MindFormers accepts becomes decoder-layer
counts per virtual stage; ``pipeline_parallel_schedule`` with ``pipeline_parallel_interleave_num``
becomes the schedule to run; ``pipeline_parallel_microbatch_size`` is the number of
micro-batches per step.

With ``P = pipeline_parallel`` ranks and ``V = pipeline_parallel_interleave_num`` chunks per
rank there are ``P x V`` virtual stages; chunk ``c`` of rank ``r`` is virtual stage
``c * P + r``, and virtual stages take consecutive decoder layers in their order.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from mindtrain.config.errors import ConfigError

FIELD = "parallelism.pipeline_parallel_layers_per_stage"
SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")


def resolve_schedule(schedule: str, chunks: int) -> str:
    """The schedule to run: ``"1f1b"`` with ``chunks > 1`` becomes ``"interleaved_1f1b"``
    (MindFormers infers it the same way); the combinations that cannot run raise."""
    kind = schedule.lower() if isinstance(schedule, str) else schedule
    if kind not in SCHEDULES:
        raise ConfigError("parallelism.pipeline_parallel_schedule",
                          f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not _int(chunks) or chunks < 1:
        raise ConfigError("parallelism.pipeline_parallel_interleave_num", f"must be an integer >= 1, got {chunks!r}")
    if kind == "1f1b" and chunks > 1:
        return "interleaved_1f1b"
    if kind == "interleaved_1f1b" and chunks == 1:
        raise ConfigError("parallelism.pipeline_parallel_schedule",
                          "interleaved_1f1b needs pipeline_parallel_interleave_num > 1; use 1f1b or raise it")
    if kind == "gpipe" and chunks > 1:
        raise ConfigError("parallelism.pipeline_parallel_schedule",
                          "gpipe runs one model chunk per stage; use interleaved_1f1b or "
                          "pipeline_parallel_interleave_num: 1")
    return kind


def check_micro_batches(schedule: str, stages: int, micro_batches: int) -> None:
    """Interleaved 1F1B needs the micro-batches of a step to be a multiple of the stages."""
    if schedule == "interleaved_1f1b" and micro_batches % stages:
        raise ConfigError("training.global_batch_size",
                          f"interleaved_1f1b needs the micro-batches per step and data-parallel rank "
                          f"(global_batch_size / (data parallel x local_batch_size) = {micro_batches}) to be a "
                          f"multiple of pipeline_parallel ({stages})")


def microbatch_note(value: int, stages: int, micro_batches: int) -> Optional[str]:
    """``pipeline_parallel_microbatch_size`` is, in MindFormers, the number of micro-batches a
    pipeline step runs, and its trainer sets it to the gradient-accumulation count
    ``global_batch_size / (data parallel x local_batch_size)`` whatever the YAML says. mindtrain
    does the same and says so (a start-up line) when a pipeline runs with a different value."""
    if not _int(value) or value < 1:
        raise ConfigError("parallelism.pipeline_parallel_microbatch_size", f"must be an integer >= 1, got {value!r}")
    if stages > 1 and value != micro_batches:
        return (f"parallelism.pipeline_parallel_microbatch_size: {value} is replaced by {micro_batches}, the "
                f"micro-batches per step (global_batch_size / (data parallel x local_batch_size)), as MindFormers does")
    return None


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _range(text: str) -> tuple[int, int]:
    """``"a-b"`` (inclusive) or ``"a"`` -> ``(a, b)``."""
    parts = text.strip().split("-")
    try:
        if len(parts) > 2:
            raise ValueError
        start, end = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ConfigError(FIELD, f"{text.strip()!r} is not a layer range; write 'start-end' or one layer id") from None
    if start > end:
        raise ConfigError(FIELD, f"range {text.strip()!r} ends before it starts")
    return start, end


def layer_counts(value: Any, num_layers: int, stages: int, chunks: int = 1) -> Optional[list[int]]:
    """Decoder layers of each virtual stage (``stages x chunks`` entries in virtual-stage
    order), or ``None`` for the balanced split (``null`` / ``"auto"``).

    Accepted, as in MindFormers: ``"auto"``/``null``; a list of one string per rank with
    ``chunks`` comma-separated inclusive layer ranges (``["0-1,4-5", "2-3,6-7"]``: chunk ``c``
    of rank ``r`` runs those layers); a list of one list of ``chunks`` layer counts per rank
    (``[[2, 2], [2, 2]]``); and mindtrain's list of layer counts per virtual stage (``[2, 2]``
    without interleaving). The ranges must cover layers 0..num_layers-1 once, in virtual-stage
    order; only the first and last virtual stage (embedding; head and MTP) may have no layer.
    """
    if value is None or value == "auto":
        if stages * chunks > num_layers + 1:
            raise ConfigError("parallelism.pipeline_parallel",
                              f"{stages} stages x {chunks} chunks is more than model.num_hidden_layers "
                              f"({num_layers}) + 1 virtual stages")
        return None
    n_virtual = stages * chunks
    if not isinstance(value, list) or not value:
        raise ConfigError(FIELD, f"must be \"auto\", null or a list with one entry per pipeline stage, got {value!r}")
    if all(_int(x) for x in value):
        if len(value) != n_virtual:
            raise ConfigError(FIELD, f"a list of layer counts needs one entry per virtual stage "
                                     f"(pipeline_parallel x pipeline_parallel_interleave_num = {n_virtual}), "
                                     f"got {len(value)}")
        counts = list(value)
    elif all(isinstance(x, list) for x in value):
        if len(value) != stages or any(len(x) != chunks or not all(_int(c) for c in x) for x in value):
            raise ConfigError(FIELD, f"a list of lists needs {stages} lists (one per pipeline stage) of "
                                     f"{chunks} layer counts (one per chunk), got {value!r}")
        counts = [value[v % stages][v // stages] for v in range(n_virtual)]
    elif all(isinstance(x, str) for x in value):
        if len(value) != stages:
            raise ConfigError(FIELD, f"needs one string per pipeline stage ({stages}), got {len(value)}")
        ranges = [[_range(r) for r in text.split(",")] for text in value]
        for r, chunk_ranges in enumerate(ranges):
            if len(chunk_ranges) != chunks:
                raise ConfigError(FIELD, f"stage {r} ({value[r]!r}) has {len(chunk_ranges)} comma-separated "
                                         f"range(s); pipeline_parallel_interleave_num is {chunks}")
        spans = [ranges[v % stages][v // stages] for v in range(n_virtual)]
        expected = 0
        for v, (start, end) in enumerate(spans):
            if start != expected:
                raise ConfigError(FIELD, f"virtual stage {v} (stage {v % stages}, chunk {v // stages}) starts at "
                                         f"layer {start}; it must start at {expected} (ranges cover the layers "
                                         f"in order: chunk c of stage r is virtual stage c x {stages} + r)")
            expected = end + 1
        if expected != num_layers:
            raise ConfigError(FIELD, f"the ranges end at layer {expected - 1}; model.num_hidden_layers is {num_layers}")
        counts = [end - start + 1 for start, end in spans]
    else:
        raise ConfigError(FIELD, f"must be \"auto\", null, or a list of ints, of lists of ints or of strings, "
                                 f"got {value!r}")
    if sum(counts) != num_layers or min(counts) < 0:
        raise ConfigError(FIELD, f"{value!r}: layer counts must be >= 0 and sum to model.num_hidden_layers "
                                 f"({num_layers})")
    if any(c == 0 for c in counts[1:-1]):
        raise ConfigError(FIELD, f"{value!r}: only the first and last virtual stage may have no decoder layer")
    return counts


def partition_units(units: Sequence[Any], stages: int, layers_per_stage: Any = None,
                    chunks: int = 1) -> list[list[str]]:
    """Unit names per virtual stage (``stages x chunks`` lists; chunk ``c`` of rank ``r`` is
    entry ``c * stages + r``) of the ordered ``units`` (records with ``["name"]`` and
    ``["kind"]``: :class:`mindtrain.config.plan.UnitPlan` or dicts): the embedding with the
    first, the head and MTP modules with the last, decoder layers in order, balanced by count
    (earlier virtual stages take the remainder, since the last one also holds the head and
    MTP) or as ``layers_per_stage`` says (any form of :func:`layer_counts`)."""
    decoders = [u["name"] for u in units if u["kind"] == "decoder"]
    n = len(decoders)
    n_virtual = stages * chunks
    counts = layer_counts(layers_per_stage, n, stages, chunks)
    if counts is None:
        base, extra = divmod(n, n_virtual)
        counts = [base + (1 if i < extra else 0) for i in range(n_virtual)]
    out, start = [], 0
    for i, c in enumerate(counts):
        names = decoders[start:start + c]
        start += c
        if i == 0:
            names = [u["name"] for u in units if u["kind"] == "embedding"] + names
        if i == n_virtual - 1:
            names = names + [u["name"] for u in units if u["kind"] in ("head", "mtp")]
        out.append(names)
    return out
