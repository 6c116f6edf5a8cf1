"""monitor.train_state: per-parameter gradient norms and each rank's losses, as the log
records of MindFormers' PyNative TrainStateMonitor (mindformers/pynative/tools/monitor.py).

- ``local_norm`` (true, a name pattern or a list of them): the L2 norm of each selected
  parameter's gradient as this rank holds it (its FSDP/TP/EP piece), printed by every rank.
- ``local_loss``: this rank's loss of each micro-batch, printed by every rank.
- ``device_norm`` (true or patterns): each selected parameter's gradient norm over the whole
  model, printed by rank 0: every rank adds the squares of its pieces (a piece several ranks
  hold counted once) into one entry per parameter, and one all-reduce of that small vector
  sums them (:class:`DeviceNorms`); no rank gathers a gradient.
- ``device_loss``: the step's loss of every rank and their mean, printed by rank 0.

Norms are of the step's gradient (summed over micro-batches) before clipping. A pattern
selects the parameters whose name contains it, as MindFormers matches them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

from mindtrain.config import ConfigError

NormSetting = Union[bool, str, list]


def parameter_norms(named_arrays: Sequence[tuple[str, np.ndarray]]) -> dict[str, float]:
    """L2 norm of each array, computed in float64."""
    return {name: float(np.sqrt(np.sum(np.square(np.asarray(a), dtype=np.float64)))) for name, a in named_arrays}


class DeviceNorms:
    """Each parameter's gradient norm over all ranks from this rank's pieces (``shards``:
    :meth:`mindtrain.parallel.Layout.shards`, aligned with the gradients). On first use the
    ranks exchange their piece lists (``all_gather_bytes``) to learn every parameter's name
    and how many ranks hold each piece; then per call each rank puts the sum of squares of its
    pieces, divided by that count, into a float64 vector with one entry per parameter, and
    ``all_sum`` (an all-reduce) adds the vectors."""

    def __init__(self, shards: Sequence, all_gather_bytes: Callable[[bytes], list[bytes]],
                 all_sum: Callable[[np.ndarray], np.ndarray]):
        self.shards = list(shards)
        self._gather = all_gather_bytes
        self._sum = all_sum
        self.names: Optional[list[str]] = None
        self._index: list[int] = []
        self._share: list[float] = []

    def _exchange(self) -> None:
        keys = [[s.name, list(s.offset), list(s.shape)] for s in self.shards if s.numel or not s.shape]
        everyone = [json.loads(b) for b in self._gather(json.dumps(keys).encode())]
        names: dict[str, int] = {}
        holders: dict[str, int] = {}
        for pieces in everyone:
            for name, offset, shape in pieces:
                names.setdefault(name, len(names))
                key = json.dumps([name, offset, shape])
                holders[key] = holders.get(key, 0) + 1
        self.names = list(names)
        self._index = [names[s.name] for s in self.shards]
        self._share = [1.0 / holders.get(json.dumps([s.name, list(s.offset), list(s.shape)]), 1) for s in self.shards]

    def __call__(self, grads: Sequence, selected: Callable[[str], bool]) -> dict[str, float]:
        """``{name: norm}`` of the parameters ``selected`` keeps (a collective: every rank calls
        it with the same selection)."""
        if self.names is None:
            self._exchange()
        squares = np.zeros(len(self.names), np.float64)
        for sh, g, i, share in zip(self.shards, grads, self._index, self._share):
            if sh.numel and selected(sh.name):
                piece = np.asarray(sh.take(g.asnumpy()), np.float64)
                squares[i] += float(np.sum(piece * piece)) * share
        total = np.asarray(self._sum(squares), np.float64)
        return {n: float(np.sqrt(total[i])) for i, n in enumerate(self.names) if selected(n)}


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

    def observe(self, step: int, named_grads: Sequence[tuple[str, object]], device_norms: Optional[DeviceNorms],
                micro_losses: Sequence[float], device_losses: Sequence[float]) -> TrainStateRecord:
        """The figures of ``step``. ``named_grads``: this rank's gradients (tensors) by
        parameter name; ``device_norms`` combines their pieces over ranks (a collective: every
        rank calls ``observe`` on the same steps)."""
        local = parameter_norms([(n, g.asnumpy()) for n, g in named_grads if self._selected(self.local_norm, n)])
        device: dict[str, float] = {}
        if self.device_norm is not None:
            device = device_norms([g for _, g in named_grads], lambda n: self._selected(self.device_norm, n))
        return TrainStateRecord(step, local, device, [float(v) for v in micro_losses] if self.local_loss else [],
                                [float(v) for v in device_losses] if self.device_loss else [])
