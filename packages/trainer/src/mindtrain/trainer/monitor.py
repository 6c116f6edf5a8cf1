"""monitor.train_state: per-parameter norms and local / device-level losses as log lines."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def parameter_norms(named_arrays: Sequence[tuple[str, np.ndarray]]) -> dict[str, float]:
    """L2 norm of each parameter, computed in float64."""
    return {name: float(np.sqrt(np.sum(np.square(a, dtype=np.float64)))) for name, a in named_arrays}


def format_train_state(step: int, total: int, local_losses: Sequence[float], device_losses: Sequence[float],
                       param_norms: dict[str, float]) -> list[str]:
    """Log lines: rank 0's per-micro-batch losses, each device's loss, then one line per parameter."""
    head = f"{{ step:[{step:5d}/{total:5d}], train_state"
    local = ", ".join(f"{v:.6f}" for v in local_losses)
    device = ", ".join(f"rank{r}: {v:.6f}" for r, v in enumerate(device_losses))
    lines = [f"{head}, local_loss: [{local}] }}", f"{head}, device_loss: [{device}] }}"]
    lines += [f"{head}, param_norm: {name}: {norm:.6e} }}" for name, norm in param_norms.items()]
    return lines
