"""The per-step log line, in exactly the quick start's shape."""

from __future__ import annotations

import math
import os
import re
from typing import Optional, Sequence


def format_flops(flops_per_second: float) -> str:
    """'  1.36T': always in T (1e12 FLOP/s) as MindFormers prints it; below 1T with two
    significant digits ('0.0012T'), so a small figure never reads '0.00T'."""
    tera = flops_per_second / 1e12
    decimals = 2
    if 0 < tera < 0.995:  # 0.995 and above print as 1.00 with two decimals
        decimals = max(2, 1 - math.floor(math.log10(tera)))
    return f"{tera:6.{decimals}f}T"


def mtp_fields(mean_mtp_loss: float, depth: int, scaling_factor: float) -> list[tuple[str, float]]:
    """The MTP figures as MindFormers' PyNative trainer prints them
    (mindformers/pynative/callback/loss_callback.py): ``mtp_{k}_loss`` for depth k, holding
    that depth's loss x ``mtp_loss_scaling_factor / depth``. The model reports the mean over
    depths only, so depth 1 gets its exact figure and deeper MTP one ``mtp_loss`` field with
    the sum of the per-depth figures."""
    if depth <= 0:
        return []
    if depth == 1:
        return [("mtp_1_loss", scaling_factor * mean_mtp_loss)]
    return [("mtp_loss", scaling_factor * mean_mtp_loss)]


def format_step_line(step: int, total: int, loss: float, step_ms: float, lr: float, grad_norm: float,
                     flops_per_second: float, load_balancing_loss: Optional[float] = None,
                     mtp: Sequence[tuple[str, float]] = ()) -> str:
    """``{ step:[    1/   10], loss:  11.813965, per_step_time:  13570ms, ... }``.

    ``load_balancing_loss`` is printed for MoE models (None leaves it out); the ``mtp``
    (name, value) pairs (see :func:`mtp_fields`) between it and ``lr``, where MindFormers
    prints them.
    """
    parts = [f"step:[{step:5d}/{total:5d}]", f"loss: {loss:10.6f}", f"per_step_time: {int(round(step_ms)):6d}ms"]
    if load_balancing_loss is not None:
        parts.append(f"load_balancing_loss: {load_balancing_loss:10.6f}")
    parts += [f"{name}: {value:10.6f}" for name, value in mtp]
    parts += [f"lr: {lr:.6e}", f"grad_norm: {grad_norm:10.6f}", f"throughput: {format_flops(flops_per_second)}"]
    return "{ " + ", ".join(parts) + " }"


_TIMING = (re.compile(r"per_step_time: +\d+ms, "), re.compile(r", throughput: .*\}$"))


def read_step_lines(path: str) -> list[str]:
    """The step lines of a log file (``[]`` while it does not exist), as printed."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in f if line.startswith("{ step:")]


def without_timing(line: str) -> str:
    """A step line without its time-dependent fields (per_step_time, throughput): what two
    runs of the same training must print alike."""
    return _TIMING[0].sub("", _TIMING[1].sub("", line))
