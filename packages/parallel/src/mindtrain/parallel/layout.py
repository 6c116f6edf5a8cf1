"""What every layout shares: the :class:`Layout` protocol the trainer talks to, the one
gradient norm, and the one way between this rank's pieces of the parameters and their full
arrays.

A layout (FSDP x TP x EP in one process per rank, or a pipeline stage with CP inside) holds
each parameter as a *piece*: an FSDP dim-0 shard over ``dp``, a TP split, an EP / ``edp``
slice of the stacked experts, or the whole tensor. :func:`grad_norm` adds the squares of
those pieces over the ranks that hold distinct ones;
:class:`~mindtrain.parallel.share.ModelShare` undoes and redoes the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.config import StepFigures
from mindtrain.parallel import collectives as C
from mindtrain.parallel.group import Group


@runtime_checkable
class Layout(Protocol):
    """A model laid out over a mesh, as :func:`mindtrain.parallel.parallelize` returns it
    for every combination of dimensions (pipeline included). Per optimizer step::

        figures = layout.run_step(micro_batches)   # forward + backward of this rank's share
        load = layout.expert_load()                 # tokens per expert of the global batch
        grads = layout.gradients()                  # aligned with layout.named_params
        norm = layout.grad_norm(grads)              # clip with it
        optimizer.step(grads)                       # updates the tensors of named_params
        layout.finish_step()
    """

    named_params: list
    """``(name, tensor)`` pairs the optimizer updates: this rank's pieces of the weights."""

    def run_step(self, batches: Sequence[Mapping[str, Any]]) -> list[StepFigures]:
        """Forward and backward of one optimizer step's micro-batches (dicts of arrays by
        column); the figures (floats) of this rank: one per micro-batch, or their mean."""

    def evaluate(self, batches: Sequence[Mapping[str, Any]]) -> list[StepFigures]:
        """Forward only (no gradients, no weight change) of micro-batches as :meth:`run_step`
        takes them; their figures as :meth:`run_step` returns them. Called between steps
        (after :meth:`finish_step`); it counts no expert load and makes no gradient."""

    def gradients(self) -> list[Tensor]:
        """The gradient of the global batch's mean loss, reduced over the mesh, aligned with
        :attr:`named_params`."""

    def grad_norm(self, grads: Sequence[Tensor], only: Optional[Sequence[int]] = None) -> float:
        """Global L2 norm of the whole model's gradient (each piece counted once); the
        same float on every rank. ``only``: of those parameters alone (indices into
        :attr:`named_params`)."""

    def expert_load(self) -> Tensor:
        """Tokens per routed expert ([moe layers, experts]) of the whole global batch."""

    def finish_step(self) -> None:
        """After the optimizer updated :attr:`named_params`: refresh gathered weights, drop
        the gradients."""

    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full-shape arrays, keyed by parameter name, of tensors laid out like
        :attr:`named_params` (the weights or optimizer moments); a collective, every rank
        gets the result."""

    def to_local(self, full: Mapping[str, Any]) -> list[Tensor]:
        """This rank's pieces of full-shape arrays, aligned with :attr:`named_params` (the
        inverse of :meth:`to_full`, no communication)."""

    def gather_own(self, named: Sequence[tuple[str, Tensor]]) -> dict[str, np.ndarray]:
        """Full arrays of some of this rank's own parameters (``(name, tensor laid out like
        it)`` pairs, the same names in the same order on every rank of its stage): a
        collective over the groups holding their pieces, never across pipeline stages; it
        holds only those parameters' full arrays (an optimizer that needs whole matrices
        gathers a bounded batch at a time)."""

    def scatter_own(self, full: Mapping[str, Any]) -> list[Tensor]:
        """This rank's pieces of full arrays of its own parameters, in ``full``'s order (the
        inverse of :meth:`gather_own`, no communication)."""

    def memory_bytes(self) -> int:
        """Bytes of parameters resident on this rank between steps."""

    def ep_sent_bytes(self) -> int:
        """Bytes this rank sent to the other expert-parallel ranks in dispatch and combine
        (forward), so far; 0 without expert parallelism."""

    def shards(self) -> list["Shard"]:
        """Where each of :attr:`named_params` sits in its full array (no communication):
        what a sharded checkpoint writes and reads for this rank."""

    def load_params(self, pieces: Iterable[np.ndarray]) -> None:
        """Write this rank's pieces (laid out like :attr:`named_params`, e.g. read by
        :attr:`shards` from a checkpoint) into the weights, and refresh what the layout
        keeps gathered from them (a collective under FSDP ZeRO-1/2)."""


@dataclass(frozen=True)
class Shard:
    """The box of a full array that one rank's piece of a parameter holds: ``shape`` elements
    from ``offset`` on, per dimension, of the ``global_shape`` array ``name``. Every layout
    cuts contiguous ranges per dimension (TP, FSDP's dim 0, EP's experts), so a piece is
    always such a box; an FSDP shard past the last row is empty (``shape[0] == 0``).

    The local tensor may be longer than the box (FSDP pads dim 0 to a multiple of the group):
    the box is its first :attr:`numel` elements in row-major order."""

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def key(self) -> tuple:
        """What identifies the piece across ranks (replicas share it)."""
        return (self.name, self.offset, self.shape)

    def take(self, local: np.ndarray) -> np.ndarray:
        """The box's values from a local tensor's array (padding dropped; a view)."""
        return np.asarray(local).reshape(-1)[:self.numel].reshape(self.shape)

    def place(self, piece: np.ndarray, local_shape: Sequence[int]) -> np.ndarray:
        """A local tensor's array holding ``piece`` (zeros in the padding)."""
        if tuple(piece.shape) == tuple(local_shape):
            return np.ascontiguousarray(piece)
        out = np.zeros(int(math.prod(local_shape)), piece.dtype)
        out[:self.numel] = piece.reshape(-1)
        return out.reshape(tuple(local_shape))


def narrow_even(offset: list, shape: list, dim: int, parts: int, index: int) -> None:
    """Narrow the box to piece ``index`` of ``parts`` equal pieces along ``dim`` (the box
    form of :func:`split_piece`)."""
    n = shape[dim] // parts
    offset[dim] += index * n
    shape[dim] = n


def is_empty(t) -> bool:
    """A tensor without storage (a model built empty: its values come with :meth:`Layout.load_params`)."""
    return getattr(t, "device", "") == "meta"


def narrow_param(p, dim: int, parts: int, index: int) -> np.ndarray:
    """Keep piece ``index`` of ``parts`` of parameter ``p`` along ``dim`` (a parameter
    without storage keeps none: only its shape narrows). Returns the piece's values (None
    when empty)."""
    if is_empty(p):
        shape = list(p.shape)
        shape[dim] //= parts
        with ms.DeviceCtx("meta"):
            p.set_data(ops.zeros(tuple(shape), p.dtype))
        return None
    piece = split_piece(p.asnumpy(), dim, parts, index)
    p.set_data(Tensor(piece))
    return piece


def write_param(p, value: np.ndarray) -> None:
    """Write ``value`` into ``p``: in place (``ops.assign``: its existing buffer), or as new
    storage for a parameter without storage yet or that is a view of a larger buffer (the
    optimizer's flat buffer: ``ops.assign`` refuses views; the optimizer takes the new
    storage back into its buffer at its next step)."""
    value = Tensor(np.ascontiguousarray(value, np.float32))
    if is_empty(p) or p.untyped_storage().nbytes() != p.nbytes:  # no storage, or a piece of a flat buffer
        p.set_data(value)
    else:
        ops.assign(p, value)


def split_piece(full: np.ndarray, dim: int, parts: int, index: int) -> np.ndarray:
    """Piece ``index`` of ``parts`` equal pieces of ``full`` along ``dim`` (the one TP
    slicing rule: weights, their moments, expert weights' TP split)."""
    full = np.asarray(full)
    n = full.shape[dim] // parts
    return np.ascontiguousarray(np.take(full, np.arange(index * n, (index + 1) * n), axis=dim))


SQ_SUM_CHUNK = 1 << 18
"""Elements per float64 block of :func:`grad_sq_sums` (2 MB: the block stays in cache)."""


def _sq_sum(flat: np.ndarray, scratch: np.ndarray) -> float:
    """Sum of squares of a float array in float64: float64 copies of cache-sized blocks of it,
    each squared in place and summed by numpy's pairwise sum (one thread: the same digits
    whatever the thread count). BLAS's dot did the same in 7.4 ms for the bench model's 6.0M
    values on an idle machine, but its spinning threads took 230 ms on a busy one (load 11
    on 2 cores) against 3.3 ms for this (``benchmarks/RESULTS.md``, 2026-12-04)."""
    total = 0.0
    for start in range(0, flat.size, scratch.size):
        part = flat[start:start + scratch.size]
        block = scratch[:part.size]
        np.copyto(block, part)
        np.multiply(block, block, out=block)
        total += float(block.sum())
    return total


def grad_sq_sums(grads: Sequence[Tensor], groups: Union[Group, Sequence[Group]],
                 replicas: Optional[Sequence[int]] = None) -> dict[Group, float]:
    """Sum of squared gradients per group, each summed over its group (one all-reduce per
    distinct group, in float64 on the host: the same digits run after run).

    ``grads[i]`` is this rank's piece of a gradient whose pieces are distinct over
    ``groups[i]`` (one Group for all); ``replicas[i]`` (default 1) is how many ranks of that
    group hold the same piece, so a piece held by several ranks is counted once.
    """
    per = [groups] * len(grads) if isinstance(groups, Group) else list(groups)
    local: dict[Group, float] = {}
    scratch = np.empty(min(SQ_SUM_CHUNK, max((int(g.size) for g in grads), default=1) or 1), np.float64)
    for i, (g, grp) in enumerate(zip(grads, per)):
        sq = _sq_sum(g.asnumpy().reshape(-1), scratch)
        if replicas is not None and replicas[i] != 1:
            sq /= replicas[i]
        local[grp] = local.get(grp, 0.0) + sq
    return {grp: float(C.all_reduce(Tensor([v], ms.float64), grp).asnumpy()[0]) if grp.size > 1 else v
            for grp, v in local.items()}


def grad_norm(grads: Sequence[Tensor], groups: Union[Group, Sequence[Group]],
              replicas: Optional[Sequence[int]] = None) -> float:
    """Global L2 norm of a gradient held in pieces: the square root of the sum over the
    groups of :func:`grad_sq_sums`. The same float on every rank of the groups."""
    return float(math.sqrt(sum(grad_sq_sums(grads, groups, replicas).values())))


__all__ = ["Layout", "Shard", "narrow_even", "grad_norm", "grad_sq_sums", "is_empty", "narrow_param", "write_param",
           "split_piece"]
