"""Cells whose math is a function of the weights it is given.

A :class:`Block`'s computations are *pieces*: methods ``piece(self, *inputs, *weights)``
that read only their inputs, the weights passed after them and constants of the cell
(sizes, flags), never a Parameter attribute. The cell runs a piece through :meth:`Block.run`
with its own weights (:meth:`Block.piece_weights`), which are Parameters: whatever
storage they hold at the call (their own values, a tensor-parallel slice, the full weight a
ZeRO-3 unit gathered in for this call) is what the piece computes with.

Compiling (:func:`mindtrain.models.execution.apply_compile`) names the pieces that run as
``ms.jit`` graphs (:attr:`Block.compiled_pieces`). Cells of one model whose constants are equal
(every MoE layer, say) share one graph per piece through the model's :class:`GraphCache`;
MindSpore compiles one graph per ``ms.jit`` object and keeps the memory of each, so one graph
per layer would cost a layer's activations and workspace per layer. The weights are graph
*inputs*, passed as a view of each Parameter's storage (a tensor, differentiable to the
Parameter; no copy):
MindSpore keys a graph on Parameter objects and keeps the storage of the Parameters it was
compiled with, so Parameters as inputs would compile per layer again and keep every layer's
ZeRO-3-gathered weights alive after the unit frees them. A compiled piece follows a weight
whose storage a layout swaps (``set_data``) exactly as the eager one does, and nothing else
needs to know whether a piece is compiled.
"""

from __future__ import annotations

import itertools
import types

import mindspore as ms
from mindspore import Parameter, Tensor, nn
from mindspore.ops.primitive import Primitive

_SCALARS = (bool, int, float, str, type(None))
_NOT_CONSTANTS = frozenset(vars(nn.Cell())) | {"compiled_pieces", "graph_cache"}


class GraphCache:
    """The compiled pieces of one model: one ``ms.jit`` graph per (cell class, piece,
    constants), bound to the first cell that asked for it."""

    def __init__(self):
        self._graphs: dict = {}

    def graph(self, cell: "Block", name: str):
        key = (type(cell), name, constants(cell))
        entry = self._graphs.get(key)
        if entry is not None and constants(entry[0]) != key[2]:
            entry = None  # a layout changed the bound cell's constants since: bind anew
        if entry is None:
            entry = (cell, compile_method(cell, name))
            self._graphs[key] = entry
        return entry[1]

    def model_graph(self, model, name: str, cells: tuple):
        """One ``ms.jit`` graph of ``model``'s method ``name`` (a piece of the whole model,
        which reads the pieces of ``cells``), keyed by those cells' constants as :meth:`graph`."""
        key = (type(model), name, tuple(id(c) for c in cells), tuple(constants(c) for c in cells))
        entry = self._graphs.get(key)
        if entry is None:
            entry = (model, compile_method(model, name))
            self._graphs[key] = entry
        return entry[1]

    def __len__(self) -> int:
        return len(self._graphs)


_compiled = itertools.count()


def compile_method(cell: nn.Cell, name: str):
    """A new ``ms.jit`` graph of ``cell``'s method ``name``, compiled from the cell's constants
    as they are at its first call. MindSpore names a method's graph by the function (name,
    file, line) and the cell (its id and creation time), not by the cell's attributes: a
    second ``ms.jit`` of the same method on the same cell would run the graph compiled first,
    whatever the constants now say (measured: a core's causal blocks set after a first compile
    were ignored). So each graph compiles a copy of the method under a name of its own,
    bound to the cell as a private attribute (which :func:`constants` skips)."""
    fn = getattr(type(cell), name)
    own = f"_{name}_graph{next(_compiled)}"
    copy = types.FunctionType(fn.__code__, fn.__globals__, own, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
    object.__setattr__(cell, own, types.MethodType(copy, cell))
    return ms.jit(getattr(cell, own))


class Block(nn.Cell):
    """A cell that runs its pieces through :meth:`run` (see the module doc)."""

    PIECES: tuple = ()
    """The names of the cell's pieces (methods of inputs then weights)."""

    def __init__(self):
        super().__init__()
        self.compiled_pieces: frozenset = frozenset()
        """The pieces that run as graphs (empty: every piece runs eagerly)."""
        self.graph_cache = None
        """The model's :class:`GraphCache` (set with :attr:`compiled_pieces`)."""

    def piece_weights(self, name: str) -> tuple:
        """The Parameters piece ``name`` takes after its inputs, in its order (default: all
        of the cell's, in registration order)."""
        return tuple(self.get_parameters())

    def graph(self, name: str):
        """Piece ``name``'s graph if it is compiled, else None. Call it with :func:`call_graph`."""
        if name not in self.compiled_pieces or self.has_lora_dropout():
            return None
        return self.graph_cache.graph(self, name)

    def has_lora_dropout(self) -> bool:
        """True when a layer inside the cell has LoRA dropout: its adapter runs unmerged in a
        training step on numpy masks (:meth:`mindtrain.models.linear.Linear.lora_input`),
        so the cell's pieces run eagerly."""
        return any(getattr(c, "lora_dropout", 0) for _, c in self.cells_and_names())

    def functional(self):
        """``(fn, weights)`` such that ``fn(*inputs, *values)`` computes what calling the cell
        computes, with ``values`` in place of ``weights`` (Parameters, in order); None when
        the cell has no such form now. A layout that differentiates the cell itself (ZeRO-3's
        unit backward) takes the weights' gradients as gradients of ``values``: MindSpore's
        ``ms.grad(weights=Parameters)`` over a compiled graph keeps state per Parameter (a
        layer's weights per layer, measured), gradients of inputs do not."""
        return None

    def run(self, name: str, *inputs):
        """Piece ``name`` on ``inputs`` and this cell's weights, compiled when
        :attr:`compiled_pieces` has it."""
        graph = self.graph(name)
        if graph is None:
            return getattr(self, name)(*inputs, *self.piece_weights(name))
        return call_graph(graph, *inputs, *self.piece_weights(name))


def call_graph(graph, *args):
    """``graph(*args)`` with each Parameter passed as a view of its storage (see the module doc)."""
    return graph(*(graph_input(a) if isinstance(a, Parameter) else a for a in args))


def graph_input(p: Parameter):
    """``p`` as a graph input: a view of its storage (no copy; ``Parameter.value()`` copies),
    differentiable to ``p``, which MindSpore does not key a graph on."""
    return p.view(p.shape)


def constants(cell: nn.Cell) -> tuple:
    """What a piece of ``cell`` may read besides its inputs: the class and the plain
    attributes (sizes, flags, primitives' settings) of the cell and its sub-cells, tensor
    constants by shape and dtype (a piece may read a tensor attribute only if its values
    follow from the cell's sizes, as the rotary index tables do); any other object (a
    layout's hook) by identity."""
    out = []
    for path, c in cell.cells_and_names():
        items = []
        for k, v in vars(c).items():
            if type(v) is Tensor:  # a tensor constant (index tables): its shape and dtype
                items.append((k, tuple(v.shape), str(v.dtype)))
                continue
            if k[0] == "_" or k in _NOT_CONSTANTS:
                continue
            if isinstance(v, _SCALARS) or (isinstance(v, tuple) and all(isinstance(x, _SCALARS) for x in v)):
                items.append((k, v))
            elif isinstance(v, Primitive):
                items.append((k, v.name, repr(sorted(v.attrs.items()))))
            else:
                items.append((k, id(v)))
        out.append((path, type(c).__name__, tuple(items)))
    return tuple(out)


def overridden(cell: nn.Cell) -> bool:
    """True if code outside the class replaced ``cell``'s forward on the instance (a layout's
    wrapper, an eager variant): a graph compiled from the class's code would skip it."""
    return "construct" in cell.__dict__
