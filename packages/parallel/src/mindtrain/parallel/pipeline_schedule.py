"""Pipeline schedules as plain data: the ordered forward/backward work of each stage, and the
activations and gradients it receives and sends.

A pipeline of ``stages`` ranks, each holding ``chunks`` model chunks, has ``stages x chunks``
*virtual stages*: chunk ``c`` of rank ``r`` is virtual stage ``c * stages + r`` (Megatron's
and MindFormers' layout), so a micro-batch visits every rank ``chunks`` times, and the last
virtual stage always sits on the last rank.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

from mindtrain.config.pipeline import SCHEDULES, check_micro_batches, resolve_schedule

__all__ = ["SCHEDULES", "Message", "Op", "bubble_fraction", "op_messages", "resolve_schedule", "sent_messages",
           "stage_ops"]


class Op(NamedTuple):
    """One unit of a stage's work: the forward (``"F"``) or backward (``"B"``) of micro-batch
    ``micro`` through this rank's chunk ``chunk``."""

    kind: str
    micro: int
    chunk: int = 0


class Message(NamedTuple):
    """A tensor between ranks: the activation (``"A"``) going into virtual stage ``stage``, or
    the gradient (``"G"``) going back into it, for micro-batch ``micro``."""

    kind: str
    stage: int
    micro: int


def stage_ops(schedule: str, stages: int, stage: int, micro_batches: int, chunks: int = 1) -> list[Op]:
    """The ordered :class:`Op` list of ``stage`` (a rank) of ``stages`` over ``micro_batches``.

    GPipe: every forward, then every backward. 1F1B: ``stages - stage - 1`` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards, so
    at most ``stages - stage`` micro-batches are in flight on a stage. Both run backwards
    in micro-batch order.

    Interleaved 1F1B (``chunks > 1``, Megatron's virtual pipeline): forwards go over the
    chunks in groups of ``stages`` micro-batches (micro-batches 0..P-1 through chunk 0, then
    the same through chunk 1, ..., then micro-batches P..2P-1 through chunk 0, ...),
    backwards the same way from the last chunk down. ``2 (stages - stage - 1) + (chunks - 1)
    stages`` warm-up forwards, then forward/backward in turn, then the remaining backwards.
    ``micro_batches`` must be a multiple of ``stages``.
    """
    kind = resolve_schedule(schedule, chunks)
    m = micro_batches
    if kind == "gpipe":
        return [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
    if kind == "1f1b":
        warmup = min(stages - stage - 1, m)
        ops = [Op("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Op("F", warmup + i), Op("B", i)]
        return ops + [Op("B", i) for i in range(m - warmup, m)]
    check_micro_batches(kind, stages, m)
    total = m * chunks

    def nth(k: int, kind: str) -> Op:
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        return Op(kind, group * stages + within % stages, chunk if kind == "F" else chunks - 1 - chunk)

    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    ops = [nth(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        ops += [nth(warmup + k, "F"), nth(k, "B")]
    return ops + [nth(k, "B") for k in range(total - warmup, total)]


def op_messages(op: Op, stage: int, stages: int, chunks: int = 1
                ) -> tuple[Optional[tuple[int, Message]], Optional[tuple[int, Message]]]:
    """``(receive, send)`` of ``op`` run on rank ``stage``: each ``(peer rank, Message)`` or
    ``None`` (the first virtual stage receives no activation and sends no gradient, the last
    one receives no gradient and sends no activation)."""
    v = op.chunk * stages + stage
    last = stages * chunks - 1
    if op.kind == "F":
        recv = ((v - 1) % stages, Message("A", v, op.micro)) if v > 0 else None
        send = ((v + 1) % stages, Message("A", v + 1, op.micro)) if v < last else None
    else:
        recv = ((v + 1) % stages, Message("G", v, op.micro)) if v < last else None
        send = ((v - 1) % stages, Message("G", v - 1, op.micro)) if v > 0 else None
    return recv, send


def sent_messages(schedule: str, stages: int, src: int, dst: int, micro_batches: int,
                  chunks: int = 1) -> Iterator[Message]:
    """The messages rank ``src`` sends to rank ``dst``, in the order it sends them: the order a
    receiver must take them in (point-to-point messages between two ranks arrive in order)."""
    for op in stage_ops(schedule, stages, src, micro_batches, chunks):
        _, send = op_messages(op, src, stages, chunks)
        if send is not None and send[0] == dst:
            yield send[1]


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of a step with equal chunk times: ``(P-1) / (V M + P-1)`` for ``V``
    chunks per stage (1F1B and GPipe: ``V = 1``; interleaving divides the bubble by ``V``)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)
