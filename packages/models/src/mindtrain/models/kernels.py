"""The one switch between portable layers and Ascend fused kernels, and those fast paths.

The portable path (ops with CPU kernels) is the default on every device. ``use_fast_kernels
(True)`` before building a model makes its RMSNorms use ``ops.rms_norm``, attention use
``ops.flash_attention_score`` (fp16/bf16 compute only; float32 keeps the portable attention),
SwiGLU use ``ops.swiglu`` and the routed experts ``grouped_matmul``. A model reads the switch
once, when it is built (a jit-compiled layer keeps what it saw at its first compile anyway).

None of these kernels exists on CPU in MindSpore 2.10, so the fast paths are written from
the MindSpore 2.10 API documentation and have not run here; see the package README.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import ops

from mindtrain.config import UserError

# devices with the fused kernels below
FAST_DEVICES = ("Ascend",)
# the MindSpore ops behind the fast paths (nothing else in the package may call them)
FAST_OPS = ("rms_norm", "flash_attention_score", "swiglu", "grouped_matmul")

_enabled = False


class FastKernelsUnavailable(UserError):
    """Fast kernels were requested on a device that has none."""


def use_fast_kernels(enabled: bool, device: Optional[str] = None) -> None:
    """Turn the fused-kernel paths on or off for models built from now on. ``device`` (default:
    the current MindSpore device) must have the kernels when enabling."""
    global _enabled
    if enabled:
        if device is None:
            device = str(ms.get_context("device_target"))
        if device.lower() not in {d.lower() for d in FAST_DEVICES}:
            raise FastKernelsUnavailable(
                f"fast kernels need {' or '.join(FAST_DEVICES)}, this run is on {device}: RmsNorm, "
                "FlashAttentionScore, Swiglu and GroupedMatmul are Ascend-only in MindSpore 2.10; "
                "leave use_fast_kernels off for the portable path")
    _enabled = bool(enabled)


def fast_kernels_enabled() -> bool:
    return _enabled


# ----------------------------------------------------------------------------- fast paths
def fast_rms_norm(x, weight, eps: float):
    """RmsNorm kernel; statistics in float32 as the portable path (x is cast to weight's dtype)."""
    return ops.rms_norm(ops.cast(x, weight.dtype), weight, eps)[0]


def fast_swiglu(gate, up):
    """``silu(gate) * up``: ops.swiglu applies silu to the first half of its input."""
    return ops.swiglu(ops.concat((gate, up), -1), -1)


def fast_attention(q, k, v, mask_add, kernel=None):
    """FlashAttentionScore, layout BNSD. q [B,N,S,D] with the softmax scale already folded in,
    k [B,N,Sk,D], v [B,N,Sk,Dv] (fp16 or bf16); mask_add [B,N|1,S,Sk] additive (-1e9 = masked,
    any causal / packed-document pattern). Returns [B,N,S,Dv].

    The kernel needs one head size for q, k and v, a multiple of 16: all three are zero-padded
    (zero q/k columns leave the scores unchanged; zero v columns are cut off the output).
    ``kernel`` (default ops.flash_attention_score) is replaceable for checking this glue on CPU.
    """
    dqk, dv = q.shape[-1], v.shape[-1]
    d = (max(dqk, dv) + 15) // 16 * 16
    q, k, v = _pad_last(q, d), _pad_last(k, d), _pad_last(v, d)
    blocked = ops.cast(mask_add[:, :1] < -1.0, ms.uint8)                   # [B, 1, S, Sk], 1 = masked
    kernel = ops.flash_attention_score if kernel is None else kernel
    out = kernel(q, k, v, q.shape[1], attn_mask=blocked, keep_prob=1.0, scalar_value=1.0,
                 input_layout="BNSD", sparse_mode=0)
    return out[..., :dv]


def _pad_last(x, d: int):
    if x.shape[-1] == d:
        return x
    return ops.concat((x, ops.zeros(x.shape[:-1] + (d - x.shape[-1],), x.dtype)), -1)


def grouped_matmul(x, weight, group_list):
    """x [M, K] rows grouped by expert, weight [E, K, N], group_list [E] int64 cumulative row
    counts -> [M, N]. split_item=3 / group_type=0 is the form with a backward."""
    from mindspore.ops.auto_generate import grouped_matmul as gmm

    return gmm([x], [weight], group_list=group_list, split_item=3, group_type=0)[0]


def fast_routed_experts(x, topk_idx, topk_weight, gate_proj, up_proj, down_proj, dtype=None, gmm=grouped_matmul,
                        swiglu=fast_swiglu):
    """Routed experts with the (token, choice) pairs sorted by expert and one grouped matmul
    per projection. x [T, H], topk_idx [T, K], topk_weight [T, K]; weights stacked
    [E, I, H] / [E, I, H] / [E, H, I]; ``dtype`` the matmul dtype (None = as given).
    Returns (y [T, H], tokens per expert [E]). ``gmm`` and ``swiglu`` are replaceable so the
    permutation around the kernels can be checked on CPU against the portable experts."""
    t, _ = x.shape
    k = topk_idx.shape[1]
    e = gate_proj.shape[0]
    flat_e = topk_idx.reshape(-1)
    counts = ops.one_hot(flat_e, e, ms.Tensor(1, ms.int32), ms.Tensor(0, ms.int32)).sum(0)
    _, order = ops.sort(ops.cast(flat_e, ms.float32))                    # pairs grouped by expert
    order = ops.stop_gradient(ops.cast(order, ms.int32))
    token = order // k
    group_list = ops.stop_gradient(ops.cast(ops.cumsum(counts, 0), ms.int64))

    def cast(w):
        return w if dtype is None else ops.cast(w, dtype)

    xs = cast(ops.gather(x, token, 0))                                      # [N, H]
    gate = gmm(xs, cast(ops.transpose(gate_proj, (0, 2, 1))), group_list)    # [N, I]
    up = gmm(xs, cast(ops.transpose(up_proj, (0, 2, 1))), group_list)
    weight = cast(ops.gather(topk_weight.reshape(-1), order, 0).reshape(-1, 1))
    act = swiglu(gate, up) * weight
    out = gmm(act, cast(ops.transpose(down_proj, (0, 2, 1))), group_list)    # [N, H]
    y = ops.unsorted_segment_sum(out, token, t)
    return y, ops.stop_gradient(counts)
