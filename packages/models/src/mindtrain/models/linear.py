"""A bias-free (or biased) linear layer with an HF-shaped ``[out, in]`` weight."""

from __future__ import annotations

from mindspore import Tensor, nn, ops

from mindtrain.models.precision import to_compute
from mindtrain.models.weights import Init, new_weight


class Linear(nn.Cell):
    """``y = x @ weight.T (+ bias)``; ``ops.MatMul(transpose_b=True)`` is the fastest CPU form.
    With ``matmul_dtype`` set (mixed precision) the product and the output are in that dtype."""

    matmul_dtype = None
    lora_dropout = 0.0
    """``lora_config.lora_dropout`` on this layer's adapter input (set with the adapter by
    :func:`mindtrain.models.dropout.attach_lora_dropout`; a constant of compiled pieces)."""
    in_offset = 0
    """The global index of this layer's first input feature (tensor parallelism sets it on a
    row-split layer): LoRA dropout's masks are drawn per global input feature."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, init_std: float = 0.02):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_weight((out_features, in_features), Init("normal", init_std), "weight")
        self.bias = new_weight((out_features,), Init("zeros"), "bias") if bias else None
        self.lora_scaling = None
        """``lora_alpha / lora_rank`` once :func:`mindtrain.models.lora.add_adapter` gave the
        layer ``lora_a`` [r, in] and ``lora_b`` [out, r]; None without an adapter."""

    def merged_weight(self):
        """The weight the layer multiplies by: ``weight``, or with an adapter
        ``weight + scaling * lora_b @ lora_a`` (computed at each use, so gradients reach
        ``lora_a`` and ``lora_b``; on a layout's pieces: a TP slice of ``weight`` with the
        matching slice of ``lora_b`` (column split) or ``lora_a`` (row split)).

        While LoRA dropout is on (:meth:`lora_unmerged`) the adapter cannot be merged: the
        weight is ``[weight, scaling * lora_b @ lora_a]`` side by side ([out, 2 in]), to be
        multiplied with :meth:`lora_input` ``[x, dropout(x)]``, which gives MindFormers'
        unmerged ``x W^T + scaling * (dropout(x) A^T) B^T``. The pieces keep their form (they
        reshape a weight by its output rows only)."""
        if self.lora_scaling is None:
            return self.weight
        delta = _MATMUL(self.lora_b, self.adapter_a()) * self.lora_scaling
        if self.lora_unmerged():
            return ops.concat((self.weight, delta), 1)
        return self.weight + delta

    def adapter_a(self):
        """The adapter's ``lora_a`` [r, in]: this layer's own, or, for a part of a layer
        MindFormers fuses (``linear_qkv``, ``linear_fc1``) other than the first, the first
        part's, which MindFormers' one adapter on the fused weight shares between the parts
        (:func:`mindtrain.models.lora.add_adapter` with ``share_a``)."""
        owner = self.__dict__.get("_lora_a_owner")
        return self.lora_a if owner is None else owner.lora_a

    def lora_unmerged(self) -> bool:
        """True while the adapter runs unmerged: LoRA dropout is on (a training step)."""
        state = self.__dict__.get("_dropout")
        return self.lora_dropout > 0 and state is not None and state.lora_on()

    def lora_input(self, x):
        """``x`` [..., in], or while :meth:`lora_unmerged` ``[x, dropout(x)]`` [..., 2 in]: the
        input that :meth:`merged_weight` multiplies. The mask is
        :meth:`~mindtrain.models.dropout.Dropout.lora_mask`'s (the same in every layout)."""
        if not self.lora_unmerged():
            return x
        mask = self.__dict__["_dropout"].lora_mask(self.__dict__["_lora_key"], x.shape, self.in_offset)
        return ops.concat((x, x * Tensor(mask).astype(x.dtype)), -1)

    def construct(self, x):
        if self.lora_dropout:
            x = self.lora_input(x)
        return linear(x, self.merged_weight(), self.bias, self.matmul_dtype)


_MATMUL_T = ops.MatMul(transpose_b=True)
_MATMUL = ops.MatMul()


def linear(x, weight, bias=None, cd=None):
    """``x @ weight.T (+ bias)`` over the last axis of ``x``, in ``cd`` (None: float32)."""
    shape = x.shape
    flat = x if len(shape) == 2 else x.reshape(-1, shape[-1])  # a reshape is a view (eager_reshape)
    y = _MATMUL_T(to_compute(flat, cd), to_compute(weight, cd))
    if bias is not None:
        y = y + to_compute(bias, cd)
    return y if len(shape) == 2 else y.reshape(shape[:-1] + (weight.shape[0],))
