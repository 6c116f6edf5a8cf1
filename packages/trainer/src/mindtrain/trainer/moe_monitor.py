"""monitor.moe_monitor: tokens routed to each expert, as MindFormers' PyNative MoeMonitor
prints them (one JSON record per MoE layer: iter, step, block, layer, tpe).

mindtrain counts expert load per optimizer step over the whole global batch (the counts
the aux-loss-free bias update uses), so ``save_tokens_per_expert_interval`` counts
optimizer steps here where MindFormers counts micro-steps, and ``tpe`` holds the step's
total over all ranks and micro-batches (rank 0 prints it).
"""

from __future__ import annotations

import json
from typing import Optional, Sequence, Union

import numpy as np

from mindtrain.config import ConfigError


class MoeMonitor:
    """``layer_ids``: the model's MoE layers in load-row order (decoder layers, then MTP
    modules numbered after them); ``num_layers``: decoder layers."""

    def __init__(self, interval: Optional[int], target_layers: Union[None, int, list], layer_ids: Sequence[int],
                 num_layers: int):
        if interval is not None and (isinstance(interval, bool) or interval < 1):
            raise ConfigError("monitor.moe_monitor.save_tokens_per_expert_interval",
                              f"is {interval!r}; give a positive number of steps, or null to turn it off")
        self.interval = interval
        self.num_layers = num_layers
        if isinstance(target_layers, int) and not isinstance(target_layers, bool):
            targets: Optional[set] = set(range(target_layers))
        elif target_layers is None:
            targets = None
        else:
            targets = set(target_layers)
        self.rows = [(row, idx) for row, idx in enumerate(layer_ids)
                     if targets is None or (idx < num_layers and idx in targets)]
        moe = {i for i in layer_ids if i < num_layers}
        self.not_moe = sorted(targets - moe) if targets is not None and interval is not None else []

    @property
    def active(self) -> bool:
        return self.interval is not None

    def notes(self) -> list[str]:
        """Start-up notes: target layers without experts."""
        return [f"monitor.moe_monitor.target_layers: decoder layer {i} is not a MoE layer (no tokens per expert)"
                for i in self.not_moe]

    def lines(self, step: int, load) -> list[str]:
        """The records of ``step`` (none between intervals); ``load`` [moe layers, experts]."""
        if self.interval is None or step % self.interval != 0:
            return []
        counts = np.asarray(load.asnumpy() if hasattr(load, "asnumpy") else load)
        out = []
        for row, idx in self.rows:
            rec = {"iter": step, "step": step}
            if idx < self.num_layers:
                rec.update(block="decoder", layer=idx)
            else:
                rec.update(block="mtp", mtp_idx=idx - self.num_layers, layer=0)
            rec["tpe"] = [[int(round(float(v))) for v in counts[row].reshape(-1)]]
            out.append(json.dumps(rec))
        return out
