"""Rotary position embedding (plain, linear or YaRN scaling as HF computes them): DeepSeek-V3
applies it to the rope slice of q and k only, Qwen3 to the whole head."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
from mindspore import Tensor, nn, ops


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_kind(rope_scaling: Optional[dict[str, Any]]) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("type", rope_scaling.get("rope_type")) or "default"


def rope_inv_freq(dim: int, theta: float, rope_scaling: Optional[dict[str, Any]],
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin attention factor, as HF computes them
    (``default``, ``linear``: the frequencies divided by ``factor``, ``yarn``)."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    kind = _rope_kind(rope_scaling)
    if kind == "linear":
        return (1.0 / pos_freqs / np.float32(rope_scaling["factor"])).astype(np.float32), 1.0
    if kind != "yarn":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    rs = rope_scaling
    # HF: the pretraining length defaults to max_position_embeddings
    original = rs.get("original_max_position_embeddings") or max_position_embeddings
    factor = rs.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF avoids the singular ramp the same way
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_factor = 1 - ramp
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(qk_head_dim: int, rope_scaling: Optional[dict[str, Any]]) -> float:
    """``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` under YaRN (as DeepSeek-V3)."""
    scale = qk_head_dim ** -0.5
    if _rope_kind(rope_scaling) != "default":
        mscale_all_dim = rope_scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(float(rope_scaling["factor"]), mscale_all_dim)
            scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Cell):
    """Makes (cos, sin) of shape [B, S, dim] for given position ids; dim = qk_rope_head_dim
    (DeepSeek-V3) or head_dim (Qwen3)."""

    def __init__(self, dim: int, theta: float, rope_scaling: Optional[dict[str, Any]],
                 max_position_embeddings: int):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(dim, theta, rope_scaling, max_position_embeddings)
        self.inv_freq = Tensor(inv_freq)

    def construct(self, position_ids):
        freqs = ops.expand_dims(position_ids.astype(self.inv_freq.dtype), -1) * self.inv_freq
        emb = ops.concat((freqs, freqs), -1)
        return ops.cos(emb) * self.attention_factor, ops.sin(emb) * self.attention_factor


def deinterleave(x):
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek stores rope dims as pairs."""
    shape = x.shape
    d = shape[-1]
    x = x.reshape(shape[:-1] + (d // 2, 2))
    x = ops.swapaxes(x, -1, -2)
    return x.reshape(shape)


def rotate_half(x):
    d = x.shape[-1] // 2
    return ops.concat((-x[..., d:], x[..., :d]), -1)


def apply_rotary(x, cos, sin):
    """x: [B, N, S, d]; cos/sin: [B, 1, S, d]."""
    return x * cos + rotate_half(x) * sin
