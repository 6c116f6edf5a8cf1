"""Cells whose math is a function of the weights it is given.

A :class:`Block`'s computations are *pieces*: methods ``piece(self, *inputs, *weights)``
that read only their inputs, the weights passed after them and constants of the cell
(sizes, flags), never a Parameter attribute. The cell runs a piece through :meth:`Block.run`
with its own weights (:meth:`Block.piece_weights`), which are Parameters: whatever
storage they hold at the call (their own values, a tensor-parallel slice, the full weight a
ZeRO-3 unit gathered in for this call) is what the piece computes with.

Compiling (:func:`mindtrain.models.execution.apply_compile`) puts an ``ms.jit`` form of a
piece in :attr:`Block.graphs`; the weights stay graph *inputs*, so a compiled piece follows a
weight whose storage a layout swaps (``set_data``) exactly as the eager one does. Nothing
else needs to know whether a piece is compiled.
"""

from __future__ import annotations

from mindspore import nn


class Block(nn.Cell):
    """A cell that runs its pieces through :meth:`run` (see the module doc)."""

    PIECES: tuple = ()
    """The names of the cell's pieces (methods of inputs then weights)."""

    def __init__(self):
        super().__init__()
        self.graphs: dict = {}
        """Piece name -> its compiled form (empty: every piece runs eagerly)."""

    def piece_weights(self, name: str) -> tuple:
        """The Parameters piece ``name`` takes after its inputs, in its order (default: all
        of the cell's, in registration order)."""
        return tuple(self.get_parameters())

    def run(self, name: str, *inputs):
        """Piece ``name`` on ``inputs`` and this cell's weights, compiled when
        :attr:`graphs` has it."""
        fn = self.graphs.get(name)
        if fn is None:
            fn = getattr(self, name)
        return fn(*inputs, *self.piece_weights(name))


def overridden(cell: nn.Cell) -> bool:
    """True if code outside the class replaced ``cell``'s forward on the instance (a layout's
    wrapper, an eager variant): a graph compiled from the class's code would skip it."""
    return "construct" in cell.__dict__
