"""monitor.train_state: per-parameter gradient norms and each rank's losses, as the log
records of MindFormers' PyNative TrainStateMonitor (mindformers/pynative/tools/monitor.py).

- ``local_norm`` (true, a name pattern or a list of them): the L2 norm of each selected
  parameter's gradient as this rank holds it (its FSDP/TP/EP piece), printed by every rank.
- ``local_loss``: this rank's loss of each micro-batch, printed by every rank.
- ``device_norm`` (true or patterns): each selected parameter's gradient norm over the whole
  model (the full gradient gathered from every rank), printed by rank 0.
- ``device_loss``: the step's loss of every rank and their mean, printed by rank 0.

Norms are of the step's gradient (summed over micro-batches) before clipping. A pattern
selects the parameters whose name contains it, as MindFormers matches them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from mindtrain.config import ConfigError

NormSetting = Union[bool, str, list]


def parameter_norms(named_arrays: Sequence[tuple[str, np.ndarray]]) -> dict[str, float]:
    """L2 norm of each array, computed in float64."""
    return {name: float(np.sqrt(np.sum(np.square(np.asarray(a), dtype=np.float64)))) for name, a in named_arrays}


def _patterns(value: NormSetting, field: str) -> Optional[list[str]]:
    """None: off; []: every parameter; else the name patterns."""
    if isinstance(value, bool):
        return [] if value else None
    if isinstance(value, str):
        return [value] if value else None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        kept = [v for v in value if v]
        return kept or None
    raise ConfigError(f"monitor.train_state.{field}", "takes true/false, a parameter-name pattern or a list of them")


@dataclass
class TrainStateRecord:
    """One step's train_state figures; ``local_lines`` go to this rank's log, ``rank0_lines``
    only to rank 0's."""

    step: int
    local_norms: dict[str, float]
    device_norms: dict[str, float]
    local_losses: list[float]
    device_losses: list[float]

    def local_lines(self) -> list[str]:
        out = [json.dumps({"step": self.step, "micro_step": i + 1, "local_loss": v})
               for i, v in enumerate(self.local_losses)]
        out += _norm_lines(self.step, "local_norm", self.local_norms)
        return out

    def rank0_lines(self) -> list[str]:
        out = []
        if self.device_losses:
            out.append(json.dumps({"step": self.step, "device_loss": float(np.mean(self.device_losses)),
                                   "ranks": [float(v) for v in self.device_losses]}))
        return out + _norm_lines(self.step, "device_norm", self.device_norms)


def _norm_lines(step: int, kind: str, norms: dict[str, float]) -> list[str]:
    # MindFormers' shape: a header record, then one record per parameter
    if not norms:
        return []
    return [f'{{ "step": {step} }}'] + [f'{{ "{kind}": {name}: {v:10.6f} }}' for name, v in norms.items()]


class TrainStateMonitor:
    """Reads ``monitor.train_state`` and computes a step's figures from its gradients."""

    def __init__(self, local_norm: NormSetting = False, local_loss: bool = False, device_norm: NormSetting = False,
                 device_loss: bool = False):
        self.local_norm = _patterns(local_norm, "local_norm")
        self.device_norm = _patterns(device_norm, "device_norm")
        self.local_loss = bool(local_loss)
        self.device_loss = bool(device_loss)

    @classmethod
    def from_config(cls, ts) -> "TrainStateMonitor":
        return cls(ts.local_norm, ts.local_loss, ts.device_norm, ts.device_loss)

    @property
    def active(self) -> bool:
        return self.local_norm is not None or self.device_norm is not None or self.local_loss or self.device_loss

    @staticmethod
    def _selected(patterns: Optional[list[str]], name: str) -> bool:
        return patterns is not None and (not patterns or any(p in name for p in patterns))

    def observe(self, step: int, named_grads: Sequence[tuple[str, object]], to_full, micro_losses: Sequence[float],
                device_losses: Sequence[float]) -> TrainStateRecord:
        """The figures of ``step``. ``named_grads``: this rank's gradients (tensors) by
        parameter name; ``to_full(tensors) -> {name: full array}`` gathers them over ranks
        (a collective: every rank calls ``observe`` on the same steps)."""
        local = parameter_norms([(n, g.asnumpy()) for n, g in named_grads if self._selected(self.local_norm, n)])
        device: dict[str, float] = {}
        if self.device_norm is not None:
            full = to_full([g for _, g in named_grads])
            device = parameter_norms([(n, a) for n, a in full.items() if self._selected(self.device_norm, n)])
        return TrainStateRecord(step, local, device, [float(v) for v in micro_losses] if self.local_loss else [],
                                [float(v) for v in device_losses] if self.device_loss else [])
