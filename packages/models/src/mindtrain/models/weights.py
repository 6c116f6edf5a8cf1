"""How a model's parameters are made and given their first values.

Every parameter is made without storage (MindSpore's meta device) and records how it starts
(:class:`Init`: normal with a std, zeros or ones). Its values are then made from a
counter-based generator keyed by (seed, parameter name): element ``i`` of a tensor is a
function of (seed, name, i) alone, so any box of it can be made without making the rest.
One process making the whole tensor and a rank making only its piece (an FSDP shard, a TP
slice, its experts) get the same numbers, in every layout and world size.

:func:`materialize` fills a whole model (what :func:`~mindtrain.models.build_model` does by
default); a layout that keeps only a share asks :func:`initial_values` for its boxes.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor
from mindspore.common.initializer import initializer

_ATTR = "weight_init"  # the Init a parameter made here starts from (read by init_of)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 22  # elements made at a time (bounds the temporaries)


@dataclass(frozen=True)
class Init:
    """How a parameter starts: ``normal`` (mean 0, ``std``), ``zeros``, ``ones`` or ``hash``
    (element i is ``i % modulus``: DeepSeek-V4's token -> experts table, each token's K
    experts distinct and the tokens spread evenly)."""

    kind: str
    std: float = 0.0
    modulus: int = 0

    def __post_init__(self):
        if self.kind not in ("normal", "zeros", "ones", "hash"):
            raise ValueError(f"Init.kind must be normal, zeros, ones or hash, got {self.kind!r}")
        if self.kind == "hash" and self.modulus <= 0:
            raise ValueError("Init('hash') needs a modulus > 0")


_building = {"empty": False}


@contextlib.contextmanager
def empty_weights():
    """Parameters made inside have no storage (:func:`materialize` or a layout gives them
    values once their full names are known). :func:`~mindtrain.models.build_model` builds
    every model this way."""
    before = _building["empty"]
    _building["empty"] = True
    try:
        yield
    finally:
        _building["empty"] = before


def new_weight(shape: Sequence[int], init: Init, name: str, requires_grad: bool = True) -> Parameter:
    """A float32 parameter of ``shape`` starting as ``init`` says: without storage inside
    :func:`empty_weights`, else with its values at once (a cell built on its own, keyed by
    its short name)."""
    shape = tuple(int(n) for n in shape)
    if _building["empty"]:
        with ms.DeviceCtx("meta"):
            p = Parameter(initializer("zeros", shape, ms.float32), name=name, requires_grad=requires_grad)
    else:
        p = Parameter(Tensor(initial_values(name, init, shape, seed=default_seed())), name=name,
                      requires_grad=requires_grad)
    setattr(p, _ATTR, init)
    return p


def init_of(p: Parameter) -> Init:
    init = getattr(p, _ATTR, None)
    if init is None:
        raise ValueError(f"parameter {p.name} was not made by mindtrain.models.weights.new_weight")
    return init


def is_empty(t) -> bool:
    """True for a tensor without storage (made on the meta device and not filled yet)."""
    return getattr(t, "device", "") == "meta"


def default_seed() -> int:
    """ms.set_seed's seed (0 when none was set): what a model built without one starts from."""
    seed = ms.get_seed()
    return 0 if seed is None else int(seed)


def initial_values(name: str, init: Init, global_shape: Sequence[int], offset: Optional[Sequence[int]] = None,
                   shape: Optional[Sequence[int]] = None, seed: int = 0) -> np.ndarray:
    """The first values of the box ``offset``/``shape`` (default: all) of parameter ``name``
    (float32): the same numbers whichever box is asked for."""
    global_shape = tuple(int(n) for n in global_shape)
    offset = tuple(offset) if offset is not None else (0,) * len(global_shape)
    shape = tuple(shape) if shape is not None else global_shape
    if init.kind == "zeros":
        return np.zeros(shape, np.float32)
    if init.kind == "ones":
        return np.ones(shape, np.float32)
    if init.kind == "hash":
        index = np.zeros((1,) * len(shape), np.int64)
        for d, (o, n) in enumerate(zip(offset, shape)):
            stride = math.prod(global_shape[d + 1:])
            index = index + (np.arange(o, o + n, dtype=np.int64) * stride).reshape(
                [-1 if k == d else 1 for k in range(len(shape))])
        return (index % init.modulus).astype(np.float32)
    out = np.empty(shape, np.float32)
    if out.size == 0:
        return out
    key = np.uint64(_mix(np.array([(int(seed) & 0xFFFFFFFF) << 32 | zlib.crc32(name.encode())], np.uint64))[0])
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    rows_per_chunk = max(1, _CHUNK // max(1, math.prod(shape[1:]))) if shape else 1
    for r0 in range(0, shape[0] if shape else 1, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, shape[0]) if shape else 1
        index = np.zeros((1,) * len(shape), np.uint64)
        for d, (o, n, stride) in enumerate(zip(offset, shape, strides)):
            lo, hi = (o + r0, o + r1) if d == 0 else (o, o + n)
            axis = (np.arange(lo, hi, dtype=np.uint64) * np.uint64(stride)).reshape(
                [-1 if k == d else 1 for k in range(len(shape))])
            index = index + axis
        values = _normal(key, index) * init.std
        if shape:
            out[r0:r1] = values
        else:
            out[()] = values.reshape(())
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 in, uint64 out, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _normal(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """Standard normal numbers, one per element index (Box-Muller on two 24-bit uniforms)."""
    with np.errstate(over="ignore"):
        bits = _mix(index * _GOLDEN + key)
    # 24-bit uniforms in (0, 1) are exact in float32
    scale = np.float32(1.0 / (1 << 24))
    u1 = ((bits >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * scale
    u2 = ((bits & np.uint64(0xFFFFFF)).astype(np.float32) + np.float32(0.5)) * scale
    del bits
    return np.sqrt(np.float32(-2.0) * np.log(u1)) * np.cos(np.float32(2.0 * np.pi) * u2)


def materialize(model, seed: Optional[int] = None) -> None:
    """Give every parameter of ``model`` that has no storage its whole first values."""
    seed = default_seed() if seed is None else seed
    for p in model.get_parameters():
        if is_empty(p):
            p.set_data(Tensor(initial_values(p.name, init_of(p), p.shape, seed=seed)))


__all__ = ["Init", "default_seed", "empty_weights", "init_of", "initial_values", "is_empty", "materialize", "new_weight"]
