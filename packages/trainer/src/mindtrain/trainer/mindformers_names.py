"""mindtrain's parameter names <-> MindFormers' PyNative DeepSeek-V3, DeepSeek-V4 and Qwen3 /
Qwen3-MoE names (numpy only); the model config's ``model_type`` picks the map.

mindtrain names its parameters as Hugging Face does, with routed experts stacked
(``model.layers.N.mlp.experts.gate_proj [E, I, H]``). MindFormers'
``PyNativeDeepseekV3ForCausalLM`` (``auto_prefix=False`` around a ``GPTModel``) names them in
Megatron style, with fused tensors::

    mindtrain (network)                                 MindFormers PyNative
    model.embed_tokens.weight                           embedding.word_embeddings.weight
    model.layers.N.input_layernorm.weight               decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.q_a_proj.weight  [q, H]  \\
    model.layers.N.self_attn.kv_a_proj_with_mqa.weight  > decoder.layers.N.self_attention.linear_qkv.weight
                                         [c + r, H]   /    [q + c + r, H]   (rows concatenated)
    ...self_attn.q_a_layernorm / kv_a_layernorm         ...self_attention.q_layernorm / k_layernorm
    ...self_attn.q_b_proj / kv_b_proj / o_proj          ...self_attention.linear_qb / linear_kvb / linear_proj
    model.layers.N.post_attention_layernorm.weight      decoder.layers.N.pre_mlp_layernorm.weight
    ...mlp.gate_proj + mlp.up_proj  [I, H] each         ...mlp.linear_fc1.weight [2I, H], rows interleaved
                                                           g0, u0, g1, u1, ... (dense and shared experts)
    ...mlp.down_proj                                    ...mlp.linear_fc2.weight
    ...mlp.gate.weight [E, H]                           ...mlp.router.weight
    ...mlp.gate.e_score_correction_bias [E]             ...mlp.expert_bias
    (none)                                              ...mlp.tokens_per_expert [E] (a buffer, zeros)
    ...mlp.experts.gate_proj + up_proj [E, I, H]        ...mlp.experts.weight1 [E, H, 2I] = [gate^T | up^T]
    ...mlp.experts.down_proj [E, H, I]                  ...mlp.experts.weight2 [E, I, H] = down^T
    model.norm.weight                                   decoder.final_layernorm.weight
    lm_head.weight                                      output_layer.weight
    model.layers.{L+k}.enorm / hnorm / eh_proj          mtp.layers.k.enorm / hnorm / eh_proj
    model.layers.{L+k}.shared_head.norm                 mtp.layers.k.final_layernorm
    model.layers.{L+k}.<layer part>                     mtp.layers.k.transformer_layer.<layer part>

Qwen3 and Qwen3-MoE (``model_type`` qwen3 / qwen3_moe): MindFormers'
``PyNativeQwen3ForCausalLM`` (models/qwen3/modeling_qwen3_train_pynative.py, the same
``GPTModel`` with ``qk_layernorm``; Qwen3-MoE's layers are its ``MoELayer``, without expert
bias or shared experts). With G query groups (``num_key_value_heads``), n_rep = heads / G
query heads per group and head size d::

    mindtrain (network)                                 MindFormers PyNative
    model.embed_tokens.weight                           embedding.word_embeddings.weight
    model.norm.weight                                   decoder.final_layernorm.weight
    lm_head.weight (absent when tie_word_embeddings)    output_layer.weight (absent when tied)
    model.layers.N.input_layernorm.weight               decoder.layers.N.input_layernorm.weight
    model.layers.N.post_attention_layernorm.weight      decoder.layers.N.pre_mlp_layernorm.weight
    ...self_attn.q_proj / k_proj / v_proj .weight     \
          [G*n_rep*d, H] / [G*d, H] / [G*d, H]          > ...self_attention.linear_qkv.weight [G*(n_rep+2)*d, H]:
    (and .bias [rows] under attention_bias)          /     per group g, q rows of g's n_rep heads, k rows of
                                                           head g, v rows of head g (.bias alike)
    ...self_attn.o_proj.weight (.bias)                  ...self_attention.linear_proj.weight (.bias)
    ...self_attn.q_norm / k_norm .weight [d]            ...self_attention.q_layernorm / k_layernorm .weight
    ...mlp.gate_proj + up_proj / down_proj (dense)      ...mlp.linear_fc1 (rows interleaved) / linear_fc2, as above
    ...mlp.gate.weight [E, H]                           ...mlp.router.weight
    (none)                                              ...mlp.tokens_per_expert [E] (a buffer, zeros)
    ...mlp.experts.gate_proj / up_proj / down_proj      ...mlp.experts.weight1 / weight2, as above

That is the split MindFormers' ``SelfAttention`` makes (pynative/transformers/attention.py:
``linear_qkv``'s output reshaped to (..., G, (n_rep+2)*d), split (n_rep*d, d, d)) and the
layout its HF converter writes (models/qwen3/utils.py ``QKVConvertOp``, checkpoint/converter/
convert_op.py; its ``ConcatConvertOp`` interleaves ``linear_fc1``'s rows as the PyNative
``MLP`` reads them). MindFormers' Qwen3 turns ``attention_bias`` into ``add_qkv_bias`` only, so
its checkpoints hold no ``linear_proj.bias``: mindtrain's ``o_proj.bias`` takes the name
MindFormers gives that bias under ``add_bias_linear``.

Each of mindtrain's tensors has one :class:`Placement` in a MindFormers tensor: its axes
(transposed for the expert weights), then along one axis a block (the rows of ``linear_qkv``,
a half of ``weight1``), every other row (``linear_fc1``) or blocks at a period (Qwen3's q, k
and v in ``linear_qkv``: blocks of n_rep*d, d and d rows every (n_rep+2)*d). A box of
mindtrain's tensor (a rank's piece) is thus a box of MindFormers' tensor (every other row of
one for ``linear_fc1``, where the gate and up pieces of the same rows make one box together),
or, for Qwen3's q/k/v, one box per group block the piece crosses (:meth:`Placement.runs`): a
tensor-parallel slice (whole groups: q by heads, k and v by key/value heads) gives one box of
each of q, k and v per group, which join into one box of ``linear_qkv`` (the rank's groups);
an FSDP cut at any row gives several, which the writer puts in further files as it does
DeepSeek-V3's two ``linear_qkv`` parts. So a rank writes and reads MindFormers' tensors piece
by piece. Every transform only moves values, so the AdamW moments of a parameter map exactly
as the parameter does. Sizes come from the model config (``mindtrain.config.ModelConfig``).

DeepSeek-V4 (``PyNativeDeepseekV4ForCausalLM``; the names in mindformers_name_table.py) adds two
kinds: one of mindtrain's tensors kept by MindFormers as several (a hyper-connection ``scale``
[3] is ``alpha_pre`` / ``alpha_post`` / ``alpha_res``, [1] each: a placement per MindFormers
tensor, each with the ``span`` of mindtrain's indices it holds, so a rank's piece is cut at their
borders and a read joins them), and a tensor MindFormers stores in another type (the hash
table ``tid2eid``, int32; mindtrain's ids are float). MindFormers' constants that mindtrain has
none of (``tokens_per_expert``, V4's fixed RMSNorm gammas ``rms_weight`` and ``q_rms_gamma``) are
written beside the tensor that sizes them (:func:`companion_boxes`) and dropped on read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from mindtrain.config import UserError
from mindtrain.config.families import head_dim
# the name table itself (plain Python, shared with the Muon routing rule)
from mindtrain.trainer.mindformers_name_table import (_MTP, _THEIRS_LAYER, _TOP, _V4_HEAD, ADAPTERS, _family,
                                                      _layer_map, companions, is_qwen3, locate_all)


def uses_mindformers_names(names) -> bool:
    """Whether tensor names are MindFormers' (a checkpoint MindFormers wrote, or mindtrain
    with this map) rather than mindtrain's own (mindtrain before the map)."""
    return any(n.startswith(("decoder.", "embedding.", "output_layer.", "mtp.")) for n in names)


def _q_rows(cfg) -> int:
    """Rows of linear_qkv that are the query part: q_lora_rank, or the full query projection."""
    if cfg.q_lora_rank:
        return cfg.q_lora_rank
    return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


def _kv_rows(cfg) -> int:
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _groups(cfg) -> tuple[int, int, int]:
    """Qwen3's (query groups = key/value heads, query heads per group, head size)."""
    groups = int(cfg.num_key_value_heads)
    return groups, int(cfg.num_attention_heads) // groups, head_dim(cfg)


@dataclass(frozen=True)
class Placement:
    """Where one of mindtrain's tensors, or the part of it in ``span``, sits in MindFormers'
    tensor ``theirs`` (of full shape ``shape``): axis k of ``theirs`` is axis ``perm[k]`` of
    mindtrain's, and along axis ``dim`` mindtrain's index i is index ``start + stride * (i //
    block) + i % block`` of ``theirs`` (``start + stride * i`` for the default ``block`` 1):
    blocks of ``block`` rows every ``stride`` rows (Qwen3's ``linear_qkv``, one block per query
    group). ``span`` (lo, hi): only mindtrain's indices lo..hi-1 along :attr:`axis` are in
    ``theirs`` (one of several MindFormers tensors a mindtrain tensor is cut into: V4's
    hyper-connection ``scale`` [3] is three [1] tensors, ``start`` -lo); None: all of them.
    ``dtype``: the type MindFormers stores ``theirs`` as, when it is not mindtrain's (V4's
    hash table, int32); values are converted both ways (mindtrain's are float32)."""

    theirs: str
    shape: tuple[int, ...]
    perm: tuple[int, ...]
    dim: int = 0
    start: int = 0
    stride: int = 1
    block: int = 1
    span: Optional[tuple[int, int]] = None
    dtype: Optional[str] = None

    def renamed(self, theirs: str) -> "Placement":
        """The same placement in another tensor."""
        return dataclasses.replace(self, theirs=theirs)

    def moment(self, prefix: str) -> "Placement":
        """The same placement in the optimizer's tensor ``prefix + theirs`` (a moment of the
        parameter: floating point whatever the parameter is stored as)."""
        return dataclasses.replace(self, theirs=prefix + self.theirs, dtype=None)

    def clip(self, offset: Sequence[int], shape: Sequence[int]
             ) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The part of mindtrain's box ``offset``/``shape`` that is in ``theirs`` (the box
        itself without a ``span``), or None when none of it is."""
        offset, shape = tuple(int(x) for x in offset), tuple(int(x) for x in shape)
        if self.span is None:
            return offset, shape
        a = self.axis
        lo, hi = max(offset[a], self.span[0]), min(offset[a] + shape[a], self.span[1])
        if hi <= lo:
            return None
        return offset[:a] + (lo,) + offset[a + 1:], shape[:a] + (hi - lo,) + shape[a + 1:]

    @property
    def axis(self) -> int:
        """mindtrain's axis that runs along ``dim`` of ``theirs``."""
        return self.perm[self.dim]

    def index(self, i):
        """``theirs``' index along ``dim`` of mindtrain's index (or index array) ``i``."""
        return self.start + self.stride * (i // self.block) + i % self.block

    def runs(self, offset: Sequence[int], shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """mindtrain's box ``offset``/``shape`` cut where it crosses from one block into the
        next (``block`` > 1), as (offset, shape) boxes in order along :attr:`axis`: each is one
        box of ``theirs``. One run, the box itself, for ``block`` 1."""
        offset, shape = tuple(int(x) for x in offset), tuple(int(x) for x in shape)
        a = self.axis
        lo, hi = offset[a], offset[a] + shape[a]
        if self.block == 1 or hi <= lo:
            return [(offset, shape)]
        out = []
        while lo < hi:
            end = min(hi, (lo // self.block + 1) * self.block)
            out.append((offset[:a] + (lo,) + offset[a + 1:], shape[:a] + (end - lo,) + shape[a + 1:]))
            lo = end
        return out

    def box(self, offset: Sequence[int], shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of ``theirs`` that spans mindtrain's box (along ``dim`` with stride 2 it also
        spans the other part's rows in between, as it does across blocks: one of
        :meth:`runs` is a box of ``theirs`` of its own)."""
        off = [int(offset[a]) for a in self.perm]
        ext = [int(shape[a]) for a in self.perm]
        if self.block != 1:
            lo, n = off[self.dim], ext[self.dim]
            off[self.dim] = self.index(lo)
            ext[self.dim] = self.index(lo + n - 1) + 1 - off[self.dim] if n else 0
            return tuple(off), tuple(ext)
        off[self.dim] = self.start + self.stride * off[self.dim]
        ext[self.dim] = self.stride * (ext[self.dim] - 1) + 1 if ext[self.dim] else 0
        return tuple(off), tuple(ext)

    def to_theirs(self, a: np.ndarray) -> np.ndarray:
        """mindtrain's values in ``theirs``' axis order (stride aside) and type."""
        a = np.transpose(a, self.perm) if self.perm != tuple(range(len(self.perm))) else a
        return a.astype(self.dtype) if self.dtype is not None else a

    def from_theirs(self, a: np.ndarray, offset: Optional[Sequence[int]] = None) -> np.ndarray:
        """mindtrain's values from the box :meth:`box` read of ``theirs`` (for ``block`` > 1,
        the box of mindtrain's box at ``offset``, which fixes the rows it picks)."""
        if self.block != 1:
            lo = int(offset[self.axis]) if offset is not None else 0
            rows = self.index(np.arange(lo, lo + self._count(a.shape[self.dim], lo))) - self.index(lo)
            a = np.take(a, rows, axis=self.dim)
        elif self.stride != 1:
            a = a[(slice(None),) * self.dim + (slice(None, None, self.stride),)]
        if self.perm != tuple(range(len(self.perm))):
            a = np.transpose(a, np.argsort(self.perm))
        return np.ascontiguousarray(a, np.float32 if self.dtype is not None else None)

    def _count(self, span: int, lo: int) -> int:
        """How many of mindtrain's rows from ``lo`` on a span of ``span`` rows of ``theirs``
        (from ``index(lo)`` to the last of them) holds."""
        n = 0
        while True:
            step = min(self.block - (lo + n) % self.block, span)
            n += step
            span -= step + self.stride - self.block  # this run, then the other parts' rows up to the next block
            if span <= 0:
                return n


def placements(name: str, shape: Sequence[int], cfg: Any) -> list[Placement]:
    """Where mindtrain's parameter ``name`` (full shape ``shape``) sits in MindFormers'
    checkpoint: one placement, or one per MindFormers tensor it is cut into (their ``span``
    in order along the axis); a name this map does not know is a UserError."""
    shape = tuple(int(n) for n in shape)
    return [_placed(theirs, how, shape, cfg) for theirs, how in locate_all(name, cfg)]


def placement(name: str, shape: Sequence[int], cfg: Any) -> Placement:
    """:func:`placements` of a parameter that is one MindFormers tensor (or part of one)."""
    (pl,) = placements(name, shape, cfg)
    return pl


def _split(how: str) -> tuple[int, int]:
    """(k, n) of "split:k:n": part k of n equal parts along axis 0."""
    _, k, n = how.split(":")
    return int(k), int(n)


def _placed(theirs: str, how: str, shape: tuple[int, ...], cfg: Any) -> Placement:
    ident = tuple(range(len(shape)))
    if how.startswith("split:"):
        k, n = _split(how)
        size = shape[0] // n
        return Placement(theirs, (size,) + shape[1:], ident, start=-k * size, span=(k * size, (k + 1) * size))
    if how == "int32":
        return Placement(theirs, shape, ident, dtype="int32")
    if how == "q":
        return Placement(theirs, (shape[0] + _kv_rows(cfg),) + shape[1:], ident)
    if how == "kv":
        return Placement(theirs, (_q_rows(cfg) + shape[0],) + shape[1:], ident, start=_q_rows(cfg))
    if how in ("gate", "up"):
        return Placement(theirs, (2 * shape[0],) + shape[1:], ident, start=int(how == "up"), stride=2)
    if how in ("gate_t", "up_t"):  # [E, I, H] -> [E, H, 2I]
        e, i, h = shape
        return Placement(theirs, (e, h, 2 * i), (0, 2, 1), dim=2, start=i * int(how == "up_t"))
    if how == "t":  # [E, H, I] -> [E, I, H]
        return Placement(theirs, (shape[0], shape[2], shape[1]), (0, 2, 1))
    if how in ("gq", "gk", "gv"):  # per query group g: its n_rep q heads, k head g, v head g
        groups, rep, d = _groups(cfg)
        block = rep * d if how == "gq" else d
        start = {"gq": 0, "gk": rep * d, "gv": (rep + 1) * d}[how]
        return Placement(theirs, (groups * (rep + 2) * d,) + shape[1:], ident, start=start, stride=(rep + 2) * d,
                         block=block)
    return Placement(theirs, shape, ident)


def is_companion(theirs: str, cfg: Any) -> bool:
    """Whether MindFormers' tensor ``theirs`` is one of the constants mindtrain has no
    counterpart of (``tokens_per_expert``, V4's ``rms_weight`` and ``q_rms_gamma``)."""
    m = _THEIRS_LAYER.match(theirs)
    if not m:
        return False
    rest = m.group(4)
    if m.group(3) is not None and rest.startswith("transformer_layer."):
        rest = rest[len("transformer_layer."):]
    return any(rest == c for _, _, c, _ in companions(cfg))


def companion_boxes(theirs: str, offset: Sequence[int], shape: Sequence[int], cfg: Any
                    ) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], float]]:
    """The constants (:func:`is_companion`) that MindFormers' tensor ``theirs`` sizes, and
    their parts that its box ``offset``/``shape`` makes: (name, offset, shape, the axes of
    ``theirs`` the constant spans, value): the box's extent along those axes, when the box
    starts at 0 on every other axis (each part of a constant is made once, by the box that
    starts there); none otherwise."""
    out = []
    for anchor, axes, companion, value in companions(cfg):
        if not theirs.endswith("." + anchor):
            continue
        if any(int(offset[d]) != 0 for d in range(len(offset)) if d not in axes):
            continue
        out.append((theirs[:-len(anchor)] + companion, tuple(int(offset[a]) for a in axes),
                    tuple(int(shape[a]) for a in axes), axes, value))
    return out


def parts(theirs: str, shape: Sequence[int], cfg: Any) -> list[tuple[str, tuple[int, ...], Placement]]:
    """mindtrain's tensors that make up MindFormers' tensor ``theirs`` (full shape ``shape``):
    their names, full shapes and placements (none for the constants of
    :func:`is_companion`); an unknown name is a UserError."""
    shape = tuple(int(n) for n in shape)
    ident = tuple(range(len(shape)))
    if theirs.endswith(ADAPTERS):  # a LoRA adapter: placed as its layer's weight's rows (lora_b), or whole
        suffix = theirs[theirs.rindex("."):]  # (lora_a: the layer's one, which its first part holds)
        made = parts(theirs[:-len(suffix)] + ".weight", shape, cfg)
        if suffix == ".lora_a":
            return [(made[0][0][:-len(".weight")] + suffix, shape, Placement(theirs, shape, ident))]
        return [(ours[:-len(".weight")] + suffix, mine, pl.renamed(theirs)) for ours, mine, pl in made]
    top = {t: o for o, t in _TOP}
    if getattr(cfg, "model_type", None) == "deepseek_v4":  # the learned stream head
        top.update({"decoder." + t: "model." + o for o, t in _V4_HEAD})
    if theirs in top:
        return [(top[theirs], shape, Placement(theirs, shape, ident))]
    if is_companion(theirs, cfg):
        return []
    m = _THEIRS_LAYER.match(theirs)
    if not m:
        raise UserError(f"checkpoint.load_path: '{theirs}' is no parameter of MindFormers' {_family(cfg)} that "
                        "mindtrain knows; the checkpoint is of another model")
    rest = m.group(4)
    if m.group(2) is None and is_qwen3(cfg):
        raise UserError(f"checkpoint.load_path: '{theirs}' is a multi-token prediction module, which "
                        f"{_family(cfg)} has none of; the checkpoint is of another model")
    if m.group(2) is not None:
        ours = f"model.layers.{int(m.group(2))}."
    else:
        k = int(m.group(3))
        if k >= cfg.num_nextn_predict_layers:
            raise UserError(f"checkpoint.load_path: holds '{theirs}' but model.num_nextn_predict_layers is "
                            f"{cfg.num_nextn_predict_layers}; set it to the checkpoint's MTP depth")
        ours = f"model.layers.{cfg.num_hidden_layers + k}."
        for o, t in _MTP + (_V4_HEAD if getattr(cfg, "model_type", None) == "deepseek_v4" else []):
            if rest == t:
                return [(ours + o, shape, Placement(theirs, shape, ident))]
        if not rest.startswith("transformer_layer."):
            raise UserError(f"checkpoint.load_path: '{theirs}' is no part of a MindFormers MTP layer mindtrain knows")
        rest = rest[len("transformer_layer."):]
    out = []
    for o, t, how in _layer_map(cfg):
        if t != rest or (how == "q" and o.endswith("q_a_proj.weight") != bool(cfg.q_lora_rank)):
            continue
        mine = _our_shape(how, shape, cfg)
        out.append((ours + o, mine, _placed(theirs, how, mine, cfg)))
    if not out:
        raise UserError(f"checkpoint.load_path: '{theirs}' has no mindtrain counterpart; the checkpoint is of "
                        "another model")
    return out


def _our_shape(how: str, shape: tuple[int, ...], cfg: Any) -> tuple[int, ...]:
    """mindtrain's shape of the part ``how`` of a MindFormers tensor of shape ``shape``."""
    if how == "q":
        return (_q_rows(cfg),) + shape[1:]
    if how == "kv":
        return (shape[0] - _q_rows(cfg),) + shape[1:]
    if how in ("gate", "up"):
        return (shape[0] // 2,) + shape[1:]
    if how in ("gate_t", "up_t"):
        return (shape[0], shape[2] // 2, shape[1])
    if how == "t":
        return (shape[0], shape[2], shape[1])
    if how in ("gq", "gk", "gv"):
        groups, rep, d = _groups(cfg)
        return (groups * (rep if how == "gq" else 1) * d,) + shape[1:]
    if how.startswith("split:"):
        return (shape[0] * _split(how)[1],) + shape[1:]
    return shape


def to_mindformers(tensors: dict[str, np.ndarray], cfg: Any, buffers: bool = False) -> dict[str, np.ndarray]:
    """mindtrain-named arrays (network names, stacked experts) under MindFormers' PyNative
    names and layouts. ``buffers`` adds MindFormers' constants (:func:`is_companion`: model
    files only, not moments). A name this map does not know is a UserError."""
    out: dict[str, np.ndarray] = {}
    filled: dict[str, list[str]] = {}
    for name, a in tensors.items():
        a = np.asarray(a)
        for pl in placements(name, a.shape, cfg):
            clipped = pl.clip((0,) * a.ndim, a.shape)
            if clipped is None:
                continue
            off, shp = clipped
            part = a[tuple(slice(o, o + n) for o, n in zip(off, shp))]
            if pl.theirs not in out:
                out[pl.theirs] = np.zeros(pl.shape, pl.dtype or a.dtype)
            offset, extent = pl.box(off, shp)
            index = tuple(slice(o, o + n, pl.stride if d == pl.dim else 1)
                          for d, (o, n) in enumerate(zip(offset, extent)))
            if pl.block != 1:
                index = (slice(None),) * pl.dim + (pl.index(np.arange(off[pl.axis], off[pl.axis] + shp[pl.axis])),)
            out[pl.theirs][index] = pl.to_theirs(part)
            filled.setdefault(pl.theirs, []).append(name)
    for theirs, names in filled.items():
        need = [o for o, _, _ in parts(theirs, out[theirs].shape, cfg)]
        lacking = [n for n in need if n not in names]
        if lacking:
            raise UserError(f"checkpoint.layout: mindformers: '{lacking[0]}' is missing; MindFormers' "
                            f"{theirs.rsplit('.', 2)[-2]} needs all of {len(need)} parts")
        if buffers:
            shape = out[theirs].shape
            for companion, _, extent, _, value in companion_boxes(theirs, (0,) * len(shape), shape, cfg):
                out[companion] = np.full(extent, value, np.float32)
    return out


def from_mindformers(tensors: dict[str, np.ndarray], cfg: Any) -> dict[str, np.ndarray]:
    """MindFormers-named arrays back under mindtrain's network names (the inverse of
    :func:`to_mindformers`; the constants of :func:`is_companion` are dropped)."""
    out: dict[str, np.ndarray] = {}
    for theirs, a in tensors.items():
        a = np.asarray(a)
        for ours, shape, pl in parts(theirs, a.shape, cfg):
            off, shp = pl.clip((0,) * len(shape), shape)
            offset, extent = pl.box(off, shp)
            values = pl.from_theirs(a[tuple(slice(o, o + n) for o, n in zip(offset, extent))], off)
            if shp == shape:
                out[ours] = values
            else:  # one of the MindFormers tensors it is cut into
                out.setdefault(ours, np.zeros(shape, values.dtype))[tuple(slice(o, o + n) for o, n in
                                                                          zip(off, shp))] = values
    return out
