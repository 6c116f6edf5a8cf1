"""DeepSeek-V4's rotary tables: interleaved pairs on the trailing ``qk_rope_head_dim`` channels
of a head (the leading ones pass unchanged), as HF's ``apply_rotary_pos_emb`` for V4 does.

Tables are full-width ``[positions, dim]`` numpy arrays (cos 1 and sin 0 on the non-rope
channels), so rope is ``x * cos + (x @ R) * sin`` with ``R`` the constant pair rotation: no
strided slices of the activations (slow on CPU)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mindtrain.models.rope import rope_inv_freq


def pair_rotation(dim: int, rope_dim: int) -> np.ndarray:
    """[dim, dim] float32 ``R``: ``(x @ R)`` puts ``(-x[2i+1], x[2i])`` on each rope pair of the
    trailing ``rope_dim`` channels and 0 elsewhere."""
    r = np.zeros((dim, dim), np.float32)
    start = dim - rope_dim
    for i in range(rope_dim // 2):
        a, b = start + 2 * i, start + 2 * i + 1
        r[b, a] = -1.0
        r[a, b] = 1.0
    return r


def compress_scaling(rope_scaling: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The compressed layers' YaRN settings: HF forces ``attention_factor`` 1 (the reference
    does not scale cos/sin by YaRN's mscale)."""
    if not rope_scaling:
        return None
    kind = rope_scaling.get("type", rope_scaling.get("rope_type")) or "default"
    if kind == "default":
        return None
    out = dict(rope_scaling)
    out.setdefault("attention_factor", 1.0)
    return out


def rope_tables(positions: np.ndarray, dim: int, rope_dim: int, theta: float,
                rope_scaling: Optional[dict[str, Any]], max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [len(positions), dim] float32 for the trailing ``rope_dim`` channels (each
    frequency on both channels of its pair), 1 and 0 on the others."""
    inv_freq, factor = rope_inv_freq(rope_dim, theta, rope_scaling, max_positions)
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    cos = np.repeat(np.cos(freqs) * np.float32(factor), 2, axis=-1).astype(np.float32)
    sin = np.repeat(np.sin(freqs) * np.float32(factor), 2, axis=-1).astype(np.float32)
    n = len(positions)
    full_cos = np.ones((n, dim), np.float32)
    full_sin = np.zeros((n, dim), np.float32)
    full_cos[:, dim - rope_dim:] = cos
    full_sin[:, dim - rope_dim:] = sin
    return full_cos, full_sin
