"""Activation recompute (checkpointing) for MindSpore PyNative.

:class:`Recompute` is MindSpore's own PyNative recompute cell (the one behind
``mindspore.recompute`` and ``Cell.recompute()``), made once per recomputed cell: a cell
with a custom ``bprop``, so MindSpore runs its forward under no-grad (none of the
cell's intermediate tensors is kept) and its backward runs the forward again under a
gradient operation and hands the input *and parameter* gradients back to the outer
``value_and_grad``.

mindtrain does not write that bprop itself: in MindSpore 2.10 a hand-written bprop
cell (like mindtrain-parallel's ZeRO-3 unit) can return parameter gradients only through
this recompute cell's protocol; a plain custom bprop returning ``{Parameter: grad}`` had
its parameter gradients dropped (zeros) for the decoder layers (tested). The wrapper holds
the recomputed cell and calls it through ``Cell.__call__``, so its current ``construct``
runs (a layout's replacement, or the ``ms.jit``-compiled one: compiled layers stay
compiled). The wrapper itself is not part of the model's cell tree: parameter names,
cell paths and the parallel plans that name them do not change.

The recomputed forward must compute what the first one did: dropout masks are functions of the step and the tokens,
and its collectives (tensor, expert and context parallelism) run again in the same order
on every rank.
"""

from __future__ import annotations

from mindspore import nn
from mindspore.common.recompute import _RecomputeCell  # MindSpore's PyNative recompute cell (pinned 2.10)
from mindspore.graph.api import _pynative_executor


def grad_recording() -> bool:
    """True while PyNative records a graph for gradients (inside value_and_grad/grad)."""
    return bool(_pynative_executor.requires_grad())


_FIRST_PASSES = [0]


def in_first_pass() -> bool:
    """True during a :class:`Recompute` cell's first (no-grad) forward: its backward will
    run the same forward again."""
    return _FIRST_PASSES[0] > 0


class Recompute(_RecomputeCell):
    """Calls ``target`` keeping no activations; its backward recomputes them.
    ``forward_calls`` counts the target's forward runs (first pass and recomputation)."""

    def __init__(self, target: nn.Cell):
        super().__init__(target)
        self.forward_calls = 0

    @property
    def target(self) -> nn.Cell:
        return self.net

    def construct(self, *args, **kwargs):
        self.forward_calls += 1
        _FIRST_PASSES[0] += 1
        try:
            return super().construct(*args, **kwargs)
        finally:
            _FIRST_PASSES[0] -= 1

    def bprop(self, *args):
        self.forward_calls += 1
        return super().bprop(*args)

    def __call__(self, *args, **kwargs):
        if not grad_recording():  # no backward will come (evaluation): nothing to keep or recompute
            return self.net(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class _CurrentConstruct(nn.Cell):
    """``cell``'s current ``construct`` as a cell (the recompute cell runs it, so a cell whose
    own call is routed to its recompute cell does not call itself)."""

    def __init__(self, cell: nn.Cell):
        super().__init__(auto_prefix=False)
        self.cell = cell

    def construct(self, *args):
        return self.cell.construct(*args)


def recompute_submodule(cell: nn.Cell) -> Recompute:
    """Make every call of ``cell`` recompute: in an eager parent, the recompute cell
    becomes the cell's call route (the slot ``Cell.recompute()`` fills) and runs the cell's
    current construct; inside a compiled (``ms.jit``) parent the graph compiler's recompute
    marks the cell's operators. Returns the recompute cell."""
    wrapper = Recompute(_CurrentConstruct(cell))
    object.__setattr__(cell, "_recompute_cell", wrapper)
    cell._recompute(True)  # pylint: disable=protected-access  (graph mode: mark the operators)
    return wrapper
