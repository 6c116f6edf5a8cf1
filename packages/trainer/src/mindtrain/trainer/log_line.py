"""The per-step log line, in exactly the quick start's shape."""

from __future__ import annotations

from typing import Optional

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def format_flops(flops_per_second: float) -> str:
    """'  1.36T': the largest unit that keeps the figure >= 1, so it never prints 0.00."""
    for scale, unit in _UNITS:
        if flops_per_second >= scale:
            return f"{flops_per_second / scale:6.2f}{unit}"
    return f"{flops_per_second:6.2f}"


def format_step_line(step: int, total: int, loss: float, step_ms: float, lr: float, grad_norm: float,
                     flops_per_second: float, load_balancing_loss: Optional[float] = None,
                     mtp_loss: Optional[float] = None) -> str:
    """``{ step:[    1/   10], loss:  11.813965, per_step_time:  13570ms, ... }``.

    ``load_balancing_loss`` is printed for MoE models and ``mtp_loss`` when MTP is on;
    pass None to leave a field out.
    """
    parts = [f"step:[{step:5d}/{total:5d}]", f"loss: {loss:10.6f}", f"per_step_time: {int(round(step_ms)):6d}ms"]
    if load_balancing_loss is not None:
        parts.append(f"load_balancing_loss: {load_balancing_loss:10.6f}")
    if mtp_loss is not None:
        parts.append(f"mtp_loss: {mtp_loss:10.6f}")
    parts += [f"lr: {lr:.6e}", f"grad_norm: {grad_norm:10.6f}", f"throughput: {format_flops(flops_per_second)}"]
    return "{ " + ", ".join(parts) + " }"
