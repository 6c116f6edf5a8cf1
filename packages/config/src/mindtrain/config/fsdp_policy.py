"""``parallelism.reshard_after_forward_policy`` with MindFormers' meaning, as a plain bool.

MindFormers' PyNative FSDP frees a unit's gathered weights after its forward ("reshard")
when the policy is ``always``, keeps them until the backward with ``never``, and with
``default`` reshards unless pipeline parallelism is on (a stage then keeps its weights
gathered across its micro-batches).
"""

from __future__ import annotations

from typing import Optional

from mindtrain.config.derived import ZERO3
from mindtrain.config.errors import ConfigError

POLICIES = ("always", "never", "default")
FIELD = "parallelism.reshard_after_forward_policy"


def reshard_after_forward(policy: str, strategy: str, pipeline: bool) -> tuple[bool, Optional[str]]:
    """``(reshard, note)``: whether ZeRO-3 frees each unit's weights after its forward, and a
    start-up line when the policy cannot act as written (``None`` otherwise)."""
    if policy not in POLICIES:
        raise ConfigError(FIELD, f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    reshard = policy == "always" or (policy == "default" and not pipeline)
    note = None
    if policy != "default" and strategy != ZERO3:
        note = (f"{FIELD}={policy} has no effect: weights are resharded only under ZeRO-3 "
                f"(data_parallel_shard_strategy: {ZERO3}), not {strategy}")
    elif policy == "always" and pipeline:
        note = (f"{FIELD}=always has no effect with pipeline parallelism: a stage gathers its "
                f"ZeRO-3 weights once per step and frees them after its last backward (as never)")
    return reshard, note
