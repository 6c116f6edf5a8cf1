"""Dropout whose mask is the same in every layout: a counter-based hash, not an RNG stream.

Where (MindFormers' PyNative ``TransformerLayer``, Megatron's bias-dropout-add): ``hidden_dropout``
on the attention output and on the MLP / MoE output, each before its residual add (DeepSeek-V4:
before the hyper-connection streams' update, MindFormers' ``HyperConnectionTransformerLayer``);
``attention_dropout`` on the attention probabilities after the softmax (Megatron's and HF's
core attention; DeepSeek-V4's attention sink column is dropped before it, as HF's V4 eager
attention does). Evaluation runs without either (:attr:`Dropout.enabled` is off outside a
training step).

What: each element's keep decision is a hash of (``training.seed``, the step, the layer, the
site, the token's identity, the element's global feature / head and key position). A token's
identity (:func:`token_keys`) is a hash of its sample's token ids (the whole row) and its
position in the whole sequence, so a data-parallel rank, a context-parallel chunk, a
sequence-parallel shard, a pipeline stage or a recomputation draws the same mask for it as one
process does: nothing depends on which rank holds the token or how often the forward runs.
Two identical samples in one step get the same mask (their content is their identity).

The hashing is numpy (splitmix64's finaliser on uint64); masks enter the model as tensors,
so compiled pieces stay free of random ops (the layer whose dropout is on runs through its
sub-cells, with the masks applied between its pieces).
"""

from __future__ import annotations

import zlib
from typing import Optional

import numpy as np
from mindspore import Tensor

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
HIDDEN_ATTENTION, HIDDEN_MLP, ATTENTION_PROBS, LORA_INPUT = 1, 2, 3, 4
"""Sites: the attention output, the MLP / MoE output, the attention probabilities, a LoRA
adapter's input (keyed further by the adapted layer's name, :func:`layer_key`)."""
ENTRY_KEYS = 1 << 62
"""Attention dropout's id of a key that is not a token (DeepSeek-V4's compressed entry ``w``:
``ENTRY_KEYS + w``), past every token position."""


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def hash_keys(*keys) -> np.ndarray:
    """One uint64 per element of the broadcast of ``keys`` (ints or integer arrays)."""
    with np.errstate(over="ignore"):
        h = np.zeros((), np.uint64)
        for k in keys:
            h = _mix(h ^ (np.asarray(k).astype(np.uint64) + _GOLDEN))
    return h


def keep_scale(p: float, *keys) -> np.ndarray:
    """float32 ``1 / (1 - p)`` where the element is kept, 0 where dropped: kept with
    probability ``1 - p``, drawn from the hash of ``keys`` (a uniform of its top 24 bits)."""
    u = (hash_keys(*keys) >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))
    return np.where(u >= p, np.float32(1.0 / (1.0 - p)), np.float32(0.0))


def token_keys(input_ids) -> np.ndarray:
    """[B, S] uint64: each token's identity, from its sample's ids (CRC-32 of the row) and
    its position in the whole sequence. Context parallelism chunks these with the rest of
    the micro-batch."""
    ids = np.ascontiguousarray(np.asarray(input_ids).astype(np.int64))
    rows = np.array([zlib.crc32(r.view(np.uint8)) for r in ids], np.uint64)
    return hash_keys(rows[:, None], np.arange(ids.shape[1], dtype=np.uint64)[None, :])


class Dropout:
    """A model's dropout: the rates, and during a training step the step's key and the
    token identities of the forward that runs (:meth:`set_tokens`). One per model; its
    decoder layers and attention cells hold it (not a sub-cell: it has no weights)."""

    def __init__(self, attention: float = 0.0, hidden: float = 0.0, lora: float = 0.0):
        self.attention = float(attention)
        self.hidden = float(hidden)
        self.lora = float(lora)
        """``lora_config.lora_dropout``: on the input of each LoRA adapter (set by
        :func:`attach_lora_dropout`)."""
        self.enabled = False
        self.seed = 0
        self.step = 0
        self.tokens: Optional[np.ndarray] = None
        self.sequence_shard = (0, 1)
        """``(index, size)``: the layout's sequence-parallel split of the hidden states between
        layers (tensor parallelism sets it; this rank's rows of :attr:`tokens` are shard
        ``index`` of ``size`` equal ones)."""

    @property
    def configured(self) -> bool:
        return self.attention > 0 or self.hidden > 0 or self.lora > 0

    def begin_step(self, step: int, seed: int) -> None:
        """Dropout on for the training step ``step`` (masks keyed on ``seed`` and ``step``)."""
        self.enabled, self.step, self.seed = self.configured, int(step), int(seed)

    def end_step(self) -> None:
        """Off again (evaluation, inference)."""
        self.enabled = False
        self.tokens = None
        self.whole_tokens = None

    whole_tokens: Optional[np.ndarray] = None
    """Under context parallelism, the token identities of the whole sequence in its order
    (the rows of a layer that runs on the gathered keys: MLA's ``kv_b_proj``)."""

    def set_tokens(self, keys, whole=None) -> None:
        """The token identities [B, S] (:func:`token_keys`, of this rank's part of the
        sequence) of the forward about to run; ``whole``: the whole sequence's, when that
        part is a context-parallel chunk."""
        self.tokens = None if keys is None else np.asarray(keys, np.uint64)
        self.whole_tokens = None if whole is None else np.asarray(whole, np.uint64)

    def hidden_on(self) -> bool:
        return self.enabled and self.hidden > 0 and self.tokens is not None

    def attention_on(self) -> bool:
        return self.enabled and self.attention > 0 and self.tokens is not None

    def lora_on(self) -> bool:
        return self.enabled and self.lora > 0 and self.tokens is not None

    def active(self) -> bool:
        return self.hidden_on() or self.attention_on() or self.lora_on()

    def _rows(self, rows: int) -> np.ndarray:
        """This rank's token keys [B, rows]: :attr:`tokens`, or its sequence shard (see
        :attr:`sequence_shard`) when ``rows`` is that shard's length."""
        tok = self.tokens
        if rows != tok.shape[1] and self.whole_tokens is not None and rows == self.whole_tokens.shape[1]:
            return self.whole_tokens  # the gathered keys of the whole sequence (context parallelism)
        if rows != tok.shape[1]:
            index, size = self.sequence_shard
            if rows * size != tok.shape[1]:
                raise ValueError(f"dropout: {rows} rows of hidden state for {tok.shape[1]} tokens "
                                 f"(sequence shard {index} of {size})")
            tok = tok[:, index * rows:(index + 1) * rows]
        return tok

    def hidden_mask(self, layer: int, site: int, shape) -> Tensor:
        """The keep-and-scale mask [B, S_rows, H] of a layer's hidden output ``shape``: its
        rows are this rank's sequence shard of :attr:`tokens`."""
        b, rows, h = shape
        tok = self._rows(rows)
        m = keep_scale(self.hidden, self.seed, self.step, layer, site, tok[:, :, None],
                       np.arange(h, dtype=np.uint64)[None, None, :])
        return Tensor(np.ascontiguousarray(m))

    def attention_mask(self, layer: int, heads: int, head_offset: int, keys: int) -> Tensor:
        """The keep-and-scale mask [B, heads, S, keys] of the attention probabilities of the
        heads ``head_offset ..`` for the queries :attr:`tokens` over ``keys`` keys (the whole
        sequence in its natural order)."""
        return self.attention_mask_at(layer, heads, head_offset, np.arange(keys, dtype=np.uint64)[None, :])

    def attention_mask_at(self, layer: int, heads: int, head_offset: int, key_ids) -> Tensor:
        """The keep-and-scale mask [B * C, heads, c, K] of the attention probabilities of the
        heads ``head_offset ..`` when the queries :attr:`tokens` [B, C * c] are C chunks of c
        tokens (C = 1: the whole row) and ``key_ids`` [C, K] names each chunk's key columns
        by their place in the whole sequence (a token's position; see
        :data:`ENTRY_KEYS` for keys that are not tokens). A key's draw depends on its id,
        never on its column, so keys laid out differently (a context-parallel chunk's window
        halo) draw what one process draws for them."""
        tok = self.tokens
        key_ids = np.asarray(key_ids, np.uint64)
        chunks, k = key_ids.shape
        b, s = tok.shape
        q = tok.reshape(b * chunks, s // chunks)
        ids = np.broadcast_to(key_ids[None], (b, chunks, k)).reshape(b * chunks, 1, 1, k)
        m = keep_scale(self.attention, self.seed, self.step, layer, ATTENTION_PROBS, q[:, None, :, None],
                       np.arange(head_offset, head_offset + heads, dtype=np.uint64)[None, :, None, None], ids)
        return Tensor(np.ascontiguousarray(m))


    def lora_mask(self, layer: int, shape, in_offset: int = 0) -> np.ndarray:
        """The keep-and-scale mask (float32, ``shape``) of the input ``shape`` [..., in] of
        the adapter of the layer keyed ``layer`` (:func:`layer_key`): its leading axes are
        this rank's tokens (all of :attr:`tokens`, or its sequence shard) in order, its last
        the input features ``in_offset ..`` (a row-split layer's slice under tensor
        parallelism). Drawn per (seed, step, layer, token, global input feature)."""
        n_in = shape[-1]
        b = self.tokens.shape[0]
        total = int(np.prod(shape[:-1]))
        if total % b:
            raise ValueError(f"LoRA dropout: input {tuple(shape)} for {b} samples")
        tok = self._rows(total // b)
        m = keep_scale(self.lora, self.seed, self.step, LORA_INPUT, layer, tok[:, :, None],
                       np.arange(in_offset, in_offset + n_in, dtype=np.uint64)[None, None, :])
        return np.ascontiguousarray(m.reshape(tuple(shape)))


def layer_key(name: str) -> int:
    """A layer's key in its LoRA dropout masks: the CRC-32 of its weight's name (the same
    name in every layout)."""
    return zlib.crc32(name.encode())


def attach_lora_dropout(model, p: float) -> None:
    """LoRA dropout ``p`` (``lora_config.lora_dropout``) on every adapted Linear layer of
    ``model`` (after :func:`mindtrain.models.lora.add_adapter`): each gets the model's
    :class:`Dropout` (created if ``model`` has none) and its mask key."""
    state = getattr(model, "dropout", None)
    if state is None:
        state = Dropout()
        object.__setattr__(model, "dropout", state)
    state.lora = float(p)
    if p <= 0:
        return
    for _, cell in model.cells_and_names():
        if getattr(cell, "lora_scaling", None) is not None:
            cell.lora_dropout = float(p)
            object.__setattr__(cell, "_dropout", state)
            # the parts of a layer MindFormers fuses share its one dropout of the input: the
            # first part's key (mindtrain.models.lora.a_owner)
            owner = cell.__dict__.get("_lora_a_owner") or cell
            object.__setattr__(cell, "_lora_key", layer_key(owner.weight.name[:-len(".weight")]))
    head, head_loss = getattr(model, "lm_head", None), getattr(model, "head_loss", None)
    if head is not None and head_loss is not None and getattr(head, "lora_dropout", 0):
        head_loss.lora_input = head.lora_input  # the head + loss cell takes the head's unmerged input


def attach_dropout(model, attention: float, hidden: float) -> Dropout:
    """Give ``model`` (as ``model.dropout``), each of its decoder layers (and MTP modules)
    and their attention cells one :class:`Dropout`, and each layer's index (private
    attributes: not constants of a compiled piece, so layers still share their graphs)."""
    state = Dropout(attention, hidden)
    object.__setattr__(model, "dropout", state)
    for i, layer in enumerate(model.model.layers):
        for cell in (layer, getattr(layer, "self_attn", None)):
            if cell is not None:
                object.__setattr__(cell, "_dropout", state)
                object.__setattr__(cell, "_layer_index", i)
    return state


def hidden_dropout(cell, y, site: int):
    """``y`` [B, S, H] (a residual branch's output of ``cell``, a decoder layer given its
    :class:`Dropout` by :func:`attach_dropout`) with hidden dropout applied in a training
    step, else ``y``: MindFormers' ``hidden_states_dropout`` on the branch output before the
    residual add (or, with hyper-connections, before the streams' update). Its rows are this
    rank's tokens (or their sequence shard)."""
    state = dropout_of(cell)
    if state is None or not state.hidden_on():
        return y
    return y * state.hidden_mask(cell.__dict__["_layer_index"], site, y.shape).astype(y.dtype)


def dropout_of(cell) -> Optional[Dropout]:
    """The :class:`Dropout` attached to ``cell`` when it is active now, else None."""
    state = cell.__dict__.get("_dropout")
    return state if state is not None and state.active() else None
