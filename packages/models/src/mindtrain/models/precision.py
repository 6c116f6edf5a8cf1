"""Mixed precision: fp32 master weights, matmuls in a lower compute dtype.

The model keeps every parameter in float32. With a compute dtype other than float32, each
matmul casts its two operands to that dtype (projections, experts, attention scores and
values, lm_head); RMSNorm statistics, softmax, the router, rope tables and the loss stay in
float32, and the residual stream stays float32 (a low-precision matmul output added to it
is promoted). The casts' backward casts gradients back, so gradients arrive in float32.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import ops

from mindtrain.config import ConfigError
from mindtrain.config.plan import dispatches_synchronously

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}

# what MindSpore 2.10's CPU backend lacks, per requested compute dtype
_CPU_MISSING = {"bfloat16": "MindSpore 2.10 has no bfloat16 MatMul kernel on CPU "
                            "('Select CPU operator[MatMul] fail! Unsupported data type!')"}


def current_device() -> str:
    """The device MindSpore runs on (``ms.set_device`` / context), e.g. "CPU" or "Ascend"."""
    return str(ms.get_context("device_target"))


def synchronous_cpu_dispatch() -> bool:
    """On CPU, run every eager op to completion in the calling thread
    (``ms.runtime.launch_blocking``) and return True; on other devices do nothing and return
    False. MindSpore's default pipeline hands each PyNative op to dispatch threads; on a
    small CPU host that hand-off dominates an eager step (measured on 2 cores: the tiny
    DeepSeek-V3's eager forward + backward took ~2,000 ms asynchronous and ~230 ms
    synchronous; compiled layers are unaffected, ~100 ms either way). Call it once after
    ``ms.set_device``; it also makes an op's error surface at the op that raised it."""
    if not dispatches_synchronously(current_device()):
        return False
    ms.runtime.launch_blocking()
    return True


def _check_name(requested: str, field: str = "model.compute_dtype") -> None:
    if requested not in DTYPES:
        raise ConfigError(field, f"must be one of {', '.join(DTYPES)}, got {requested!r}")


def effective_compute_dtype(requested: str, device: str) -> tuple[str, Optional[str]]:
    """The compute dtype actually used for ``requested`` on ``device`` and a one-line note
    when it differs (None otherwise): bfloat16 on CPU becomes float32; everything else is
    used as requested."""
    _check_name(requested)
    missing = _CPU_MISSING.get(requested) if device.upper() == "CPU" else None
    if missing is None:
        return requested, None
    return "float32", f"model.compute_dtype={requested} is not available here: {missing}; computing in float32"


def resolve_compute_dtype(config_value: str, explicit: Optional[str], device: str) -> str:
    """The compute dtype a model is built with. ``explicit`` None: the config's value after
    :func:`effective_compute_dtype` (so the schema default bfloat16 runs as float32 on CPU).
    An explicit dtype is used as given; one the device cannot run is an error, not a fallback."""
    if explicit is None:
        return effective_compute_dtype(config_value, device)[0]
    _check_name(explicit)
    missing = _CPU_MISSING.get(explicit) if device.upper() == "CPU" else None
    if missing is not None:
        raise ConfigError("model.compute_dtype", f"{explicit} compute cannot run on {device}: {missing}; "
                                                 "use float16 or float32 (effective_compute_dtype gives the fallback)")
    return explicit


def effective_param_dtype(requested: str, device: str) -> tuple[str, Optional[str]]:
    """The dtype the weights are stored in for ``model.param_init_dtype`` (MindFormers'
    ``params_dtype``) on ``device``, and a one-line note when it differs: on CPU, where only
    float32 computes, bfloat16/float16 weights are float32 (their master copy is float32
    anyway). Elsewhere low-precision weights with float32 master weights in the optimizer
    (Megatron's bf16 with fp32 main params) are not built: a ConfigError."""
    _check_name(requested, "model.param_init_dtype")
    if requested == "float32":
        return "float32", None
    if device.upper() == "CPU":
        return "float32", (f"model.param_init_dtype={requested} (MindFormers' params_dtype) runs as float32 "
                           "weights on CPU, where only float32 computes; the optimizer's master weights and "
                           "moments are float32 either way")
    raise ConfigError("model.param_init_dtype", f"{requested} weights (with float32 master weights in the optimizer) "
                                                f"are not built for {device}; set it to float32 and lower the "
                                                "matmul precision with model.compute_dtype")


def check_param_dtype(param_init_dtype: str, device: str = "CPU") -> None:
    """:func:`effective_param_dtype`'s error, if any (the weights are float32)."""
    effective_param_dtype(param_init_dtype, device)


def to_compute(x, dtype):
    """``x`` cast to the compute dtype; None (float32 compute) leaves it untouched, so the
    float32 graph has no casts at all."""
    if dtype is None:
        return x
    return ops.cast(x, dtype)
