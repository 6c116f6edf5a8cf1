"""The named figures of one training step, shared by every package that produces or reads
them (the model call in the trainer, the layout engines, the pipeline schedule).

Pure Python: the fields hold whatever the producer has (MindSpore tensors inside a
forward, floats once taken to the host); the order below is the only order there is,
and code reads the figures by name.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Sequence


class StepFigures(NamedTuple):
    """One micro-batch's (or one step's averaged) losses.

    ``loss`` is what backward sees: ``lm_loss`` + the weighted ``load_balancing_loss`` +
    the scaled ``mtp_loss``. ``lm_loss`` is the figure the step line prints as ``loss``.
    """

    lm_loss: Any
    load_balancing_loss: Any
    mtp_loss: Any
    loss: Any

    @classmethod
    def from_model(cls, loss: Any, metrics: Mapping[str, Any], zero: Any) -> "StepFigures":
        """The figures of a model call ``loss, metrics = model(...)``: ``metrics`` names the
        parts (``lm_loss``, ``load_balancing_loss``, ``mtp_loss``); an absent part is ``zero``
        (e.g. no MTP, or a pipeline stage without the head)."""
        return cls(**{k: metrics.get(k, zero) for k in cls._fields[:-1]}, loss=loss)

    @classmethod
    def from_named(cls, names: Sequence[str], values: Iterable[Any]) -> "StepFigures":
        """Figures from values listed in the order ``names`` gives (e.g. a packed array);
        every field must be named exactly once."""
        values = list(values)
        if sorted(names) != sorted(cls._fields) or len(values) != len(names):
            raise ValueError(f"figures named {tuple(names)} with {len(values)} values; "
                             f"StepFigures needs exactly {cls._fields}")
        return cls(**dict(zip(names, values)))


STEP_FIGURES = StepFigures._fields
"""The field names in their order: how packed arrays of figures are laid out."""
