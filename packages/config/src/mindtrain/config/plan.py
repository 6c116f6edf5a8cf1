"""The parallel plan: how a model may be sharded, as typed plain data.

A model package builds it (``mindtrain.models.parallel_plan``) and the parallel package
applies it; both import it from here, so neither imports the other, and the parallel code
reads roles and paths from the plan instead of parameter or module names.

Pure Python. Every class also reads like the mapping it replaces (``plan["params"]``,
``info["tp"]``, ``info.get("expert")``), so code written against the earlier dict form keeps
working.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

ROLES = ("embedding", "attention", "mlp", "moe", "head")
"""What a region of the model is, for the layouts: the token embedding, an attention block,
a dense MLP, a mixture-of-experts block, the output head (its norm, projection and loss)."""

TP_STYLES = ("column", "row", "vocab", "replicated")
UNIT_KINDS = ("embedding", "decoder", "head", "mtp")
ZERO3_UNIT_KINDS = ("decoder", "mtp")
"""The unit kinds ZeRO-3 gathers one at a time outside a pipeline (mindtrain-parallel's
``ShardedLayout``); the others (embedding, head) are its root, gathered for the micro-batch."""
SYNCHRONOUS_DEVICES = frozenset({"CPU"})
"""Devices whose eager ops mindtrain runs to completion at each call (MindSpore's
``launch_blocking``: mindtrain-models' ``synchronous_cpu_dispatch`` sets it there). What
follows from it is counted by mindtrain-estimate: ZeRO-3 units release their weights'
storage in place and replay no forward (mindtrain-parallel), AdamW copies the gradients on
the host (mindtrain-trainer)."""


def dispatches_synchronously(device: str) -> bool:
    """True if mindtrain runs ``device``'s eager ops synchronously (:data:`SYNCHRONOUS_DEVICES`)."""
    return str(device).upper() in SYNCHRONOUS_DEVICES


ZERO3_BUCKET_BYTES = 16 << 20
"""ZeRO-3 units gathered (and their gradients reduce-scattered) together while their full
weights add up to at most this (mindtrain-parallel's ``fully_shard(bucket_bytes=)``): every
layer of a small model in one collective, one layer per collective once a layer is larger
(the 375M config's); mindtrain-estimate counts the largest such bucket as gathered at once."""
MOE_BLOCK = 32
"""Slots per block of the portable routed-experts dispatch (each block's expert weights are
gathered; mindtrain-models' default ``moe_block``, mindtrain-estimate's count)."""

CAUSAL_BLOCK_ROWS = 128
"""The fewest query rows of a causal row block (mindtrain-models' ``causal_blocks``): shorter
sequences than two blocks run as one."""
MAX_CAUSAL_BLOCKS = 8


def causal_block_rows(seq: int) -> int:
    """Query rows per block of a causal attention over ``seq`` keys: ``seq`` in at most
    :data:`MAX_CAUSAL_BLOCKS` blocks of at least :data:`CAUSAL_BLOCK_ROWS` rows; 0 when
    ``seq`` holds fewer than two. A block skips the keys after its last row: with G blocks
    about (G - 1) / 2G of the scores (37.5% at 4) are never computed."""
    if seq < 2 * CAUSAL_BLOCK_ROWS:
        return 0
    blocks = min(MAX_CAUSAL_BLOCKS, seq // CAUSAL_BLOCK_ROWS)
    return -(-seq // blocks)


def causal_block_elements(seq: int) -> int:
    """Mask elements the causal row blocks of one ``[seq, seq]`` plane hold (block ``j``:
    its rows over the keys up to its last row); 0 when :func:`causal_block_rows` gives none."""
    rows = causal_block_rows(seq)
    return sum((min(i + rows, seq) - i) * min(i + rows, seq) for i in range(0, seq, rows)) if rows else 0


class _Record:
    """Mapping-style reads of a dataclass's fields (``x["name"]``, ``x.get("name")``)."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._names() else default

    def __contains__(self, key: object) -> bool:
        return key in self._names()

    def keys(self):
        return list(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class ParamPlan(_Record):
    """One parameter.

    ``tp``: "column" (split the output dim), "row" (the input dim), "vocab" (the vocabulary
    rows) or "replicated", split along ``tp_dim``; ``split_field``: the config field whose
    value must divide by the TP degree for that split (named in the error when it does not).
    ``expert``: a routed-expert weight stacked on ``expert_dim`` over ``num_experts``.
    ``unit``: the name of the :class:`UnitPlan` holding it; ``role``: the region it belongs
    to (one of :data:`ROLES`, or None for norms and projections outside every region);
    ``applied_outside``: the model applies it outside its unit's cell (so a layout that
    gathers a unit's weights only while the unit runs must keep it gathered with the rest).
    """

    shape: tuple[int, ...]
    tp: str = "replicated"
    tp_dim: Optional[int] = None
    expert: bool = False
    expert_dim: Optional[int] = None
    num_experts: Optional[int] = None
    trainable: bool = True
    unit: str = ""
    role: Optional[str] = None
    split_field: Optional[str] = None
    applied_outside: bool = False

    def __post_init__(self):
        if self.tp not in TP_STYLES:
            raise ValueError(f"ParamPlan.tp must be one of {', '.join(TP_STYLES)}, got {self.tp!r}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"ParamPlan.role must be one of {', '.join(ROLES)} or None, got {self.role!r}")


@dataclass(frozen=True)
class UnitPlan(_Record):
    """A module that FSDP wraps and a pipeline stage holds: the embedding, a decoder layer,
    the head, an MTP module. ``path`` is its cell path in the model (None when it is not
    one cell, e.g. the head's norm and projection); ``layer`` its decoder-layer index."""

    name: str
    kind: str
    layer: Optional[int] = None
    params: list[str] = field(default_factory=list)
    path: Optional[str] = None

    def __post_init__(self):
        if self.kind not in UNIT_KINDS:
            raise ValueError(f"UnitPlan.kind must be one of {', '.join(UNIT_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class Region(_Record):
    """A cell the layouts treat as a whole (tensor parallelism replaces its forward):
    ``path`` in the model, ``role`` one of :data:`ROLES`.

    The one contract between a model's cells and the layouts: a cell class declares the
    region it is as ``REGION = Region.declare("attention")`` (the cell itself: an empty
    path); the model's plan finds it with :meth:`declared_by` and places it with :meth:`at`
    in :attr:`ParallelPlan.regions`, which the layouts read."""

    path: str
    role: str
    tp_counts: tuple[str, ...] = ()
    """Integer attributes of the cell, beside ``num_heads`` (and ``num_kv_heads``), that tensor
    parallelism divides by its degree: each rank runs that share (e.g. the groups of a grouped
    output projection, ``o_groups``). The model's config field of the same name must divide."""
    head_mask_arg: Optional[int] = 2
    """An attention region's forward argument (counted after the hidden states) holding one
    additive mask per query head on dim 1, which tensor parallelism narrows to the rank's
    heads; None when no argument is per head."""
    token_args: int = 0
    """How many per-token tensors [B, S] of the whole (not sequence-parallel) sequence follow
    the hidden states in the region's forward (e.g. the token ids a hash router reads):
    tensor parallelism hands each sequence shard its tokens' part of them."""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Region.role must be one of {', '.join(ROLES)}, got {self.role!r}")

    @classmethod
    def declare(cls, role: str, **options: Any) -> "Region":
        """What a cell class declares as its ``REGION``: a region of ``role`` at the cell itself
        (``options``: :attr:`tp_counts`, :attr:`head_mask_arg`, :attr:`token_args`)."""
        return cls("", role, **options)

    @staticmethod
    def declared_by(cell: Any) -> Optional["Region"]:
        """The region ``cell``'s class declares (its ``REGION``), or None."""
        region = getattr(type(cell), "REGION", None)
        return region if isinstance(region, Region) else None

    def at(self, path: str) -> "Region":
        """This region placed at ``path`` in the model."""
        return replace(self, path=path)


@dataclass(frozen=True)
class ParallelPlan(_Record):
    """Every parameter (``params``, by name), the ordered ``units``, the weights used by more
    than one unit (``shared``: name -> unit names), the ``regions`` and the sizes the splits
    must divide."""

    params: dict[str, ParamPlan]
    units: list[UnitPlan]
    shared: dict[str, list[str]] = field(default_factory=dict)
    regions: list[Region] = field(default_factory=list)
    num_attention_heads: Optional[int] = None
    num_experts: Optional[int] = None
    activation: tuple[int, ...] = ()
    """The per-token shape of the hidden states between units (a pipeline stage's message is
    ``[B, S_local, *activation]``): ``(hidden_size,)``, or ``(streams, hidden_size)`` for a
    model whose residual is several streams (hyper-connections); empty: the model's
    ``hidden_size``."""

    def role_params(self, role: str) -> list[str]:
        """Names of the parameters with ``role``, in plan order."""
        return [n for n, p in self.params.items() if p.role == role]

    def role_regions(self, role: str) -> list[str]:
        """Cell paths of the regions with ``role``, in plan order."""
        return [r.path for r in self.regions if r.role == role]


__all__ = ["ParallelPlan", "ParamPlan", "ROLES", "Region", "TP_STYLES", "UNIT_KINDS", "UnitPlan", "ZERO3_UNIT_KINDS", "MOE_BLOCK",
           "SYNCHRONOUS_DEVICES", "dispatches_synchronously"]
