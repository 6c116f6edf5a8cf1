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

The recomputed forward must compute what the first one did: the model has no dropout,
and its collectives (tensor, expert and context parallelism) run again in the same order
on every rank.
"""

from __future__ import annotations

import copy
import types

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.common._grad_function import _Function  # MindSpore's custom autograd function (pinned 2.10)
from mindspore.common.recompute import _RecomputeCell  # MindSpore's PyNative recompute cell (pinned 2.10)
from mindspore.graph.api import _pynative_executor

from mindtrain.models.weights import fill_empty

_FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


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


# ---------------------------------------------------------------- compiled layers, one graph per kind
def compiled_method(cell: nn.Cell, attr: str):
    """The class's method ``attr`` bound to ``cell``, compiled with ms.jit (it reads
    ``cell``'s parameters)."""
    return ms.jit(getattr(type(cell), attr).__get__(cell))


def install_jit(cell: nn.Cell, attr: str) -> None:
    """Replace ``cell``'s method ``attr`` on the instance by its ms.jit-compiled form, unless
    other code already replaced it, and list it in the cell's ``_mindtrain_jit``. (A compiled
    ``construct`` fails to parse once a layout replaces the cell's ``construct`` with Python
    code; a compiled method of another name does not, so cells that layouts wrap are
    compiled through such a method.)"""
    if attr in cell.__dict__:
        return
    fn = compiled_method(cell, attr)
    object.__setattr__(cell, attr, fn)
    mine = cell.__dict__.get("_mindtrain_jit")
    if mine is None:
        mine = {}
        object.__setattr__(cell, "_mindtrain_jit", mine)
    mine[attr] = fn


def compiled_copy(cell: nn.Cell) -> nn.Cell:
    """A deep copy of ``cell`` with its own parameters and the methods :func:`install_jit`
    compiled in it compiled again for the copy (a deep copy keeps the original's compiled
    functions, which read the original's parameters).

    Forwards that other code put on the instances (a layout's closure replacing a cell's
    ``construct``, e.g. tensor parallelism's) are rebuilt for the copy too: a deep copy
    shares functions, whose closures would still call the original cells. Closure contents
    that the deep copy copied (the original's cells and parameters, bound methods of its
    cells, functions replaced here) become the copy's; anything else (process groups,
    numbers, other functions) is shared. So is a cell's bound state (see
    :class:`TwinBinding`): the objects in its ``_mindtrain_bound`` and its own parameters,
    which the twin never reads."""
    memo: dict = {}
    for _, c in cell.cells_and_names():  # per-instance state (TwinBinding) is shared, not copied
        bound = c.__dict__.get(BOUND)
        if bound:
            for value in bound.values():
                memo[id(value)] = value
            for p in c.get_parameters():
                memo[id(p)] = p
    twin = copy.deepcopy(cell, memo)
    fill_empty(twin)  # weights are written in before each run: a model built empty gives them storage here
    old_fns: list = []  # (copied cell, attribute, the original's function)
    for _, c in twin.cells_and_names():
        mine = c.__dict__.get("_mindtrain_jit") or {}
        compiled = {id(fn) for fn in mine.values()}
        for attr, fn in list(c.__dict__.items()):
            if isinstance(fn, types.FunctionType) and fn.__closure__ and id(fn) not in compiled:
                old_fns.append((c, attr, fn))
        if not mine:
            continue
        fresh = {}
        for attr, fn in mine.items():
            fresh[attr] = memo[id(fn)] = compiled_method(c, attr)
            if c.__dict__.get(attr) is fn:  # else other code replaced it (rebuilt below)
                object.__setattr__(c, attr, fresh[attr])
        object.__setattr__(c, "_mindtrain_jit", fresh)
    # new functions first (with empty closure cells), so closures may refer to each other
    new_fns = []
    for c, attr, fn in old_fns:
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                 tuple(types.CellType() for _ in fn.__closure__))
        new.__kwdefaults__, new.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
        memo[id(fn)] = new
        new_fns.append((c, attr, fn, new))

    def mapped(value):
        if isinstance(value, types.MethodType) and id(value.__self__) in memo:
            return types.MethodType(value.__func__, memo[id(value.__self__)])
        return memo.get(id(value), value)

    for c, attr, fn, new in new_fns:
        for old_cell, new_cell in zip(fn.__closure__, new.__closure__):
            try:
                new_cell.cell_contents = mapped(old_cell.cell_contents)
            except ValueError:  # an empty closure cell stays empty
                pass
        object.__setattr__(c, attr, new)
    return twin


BOUND = "_mindtrain_bound"
"""The instance attribute (a dict) where a layout puts a cell's state that is not a weight
(see :class:`TwinBinding`)."""


class TwinBinding:
    """What a compiled twin takes from the cell it runs for, besides its trained weights
    (which each caller writes in: they may come gathered, or as autograd inputs).

    - The cell's untrained parameters (e.g. a router's correction bias): written into the
      twin's (``ops.assign``, which its graphs read).
    - A layout's per-cell state: expert parallelism's local experts (whose weights to run,
      where their gradients go), reached from the cell's forward through
      ``cell._mindtrain_bound``. The twin shares those objects with the cell it was copied
      from (:func:`compiled_copy` does not copy them); :meth:`load` hands the twin's cells
      this cell's dicts. The parameters of a cell with bound state belong to that state and
      the twin never reads its own: :attr:`skip` holds their ids (nothing to write)."""

    def __init__(self, twin: nn.Cell, cell: nn.Cell):
        mine = dict(twin.cells_and_names())
        self.pairs = [(mine[n], c) for n, c in cell.cells_and_names() if c.__dict__.get(BOUND)]
        self.skip = {id(p) for _, c in self.pairs for p in c.get_parameters()}
        theirs = dict(twin.parameters_and_names())
        self.buffers = [(theirs[n], p) for n, p in cell.parameters_and_names()
                        if not p.requires_grad and id(p) not in self.skip]

    def load(self) -> None:
        for twin_cell, cell in self.pairs:
            object.__setattr__(twin_cell, BOUND, cell.__dict__[BOUND])
        for target, own in self.buffers:
            ops.assign(target, own)


def cell_kind(cell: nn.Cell) -> tuple:
    """Cells of one kind can run in one compiled copy: the same class, parameters (names,
    shapes, dtypes, trained or not) and the same sub-cells compiled and recomputed."""
    cells = tuple((n, type(c).__qualname__, tuple(sorted(c.__dict__.get("_mindtrain_jit") or ())),
                   "_recompute_cell" in c.__dict__) for n, c in cell.cells_and_names())
    params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in cell.parameters_and_names())
    return type(cell).__qualname__, cells, params


class SharedGraphRecompute:
    """Full recompute of a compiled layer through one compiled copy (the *twin*) shared by
    every layer of its kind.

    On CPU each compiled graph keeps its own workspace for as long as it lives, so a
    compiled model holds one per layer, recompute or not. Here a layer's forward writes its
    weights into the twin's (``ops.assign``, which the twin's graph reads), runs the twin
    without keeping anything but its inputs, and its backward writes them again, runs the
    twin's forward and backward, and hands the gradients of the layer's inputs and weights
    back (a custom autograd function whose inputs include the layer's weights, so the
    outer ``value_and_grad`` sees them as the layer's). One graph per kind instead of one
    per layer; the same compiled ops in the same order, so the numbers do not change.

    ``grad_inputs`` leading arguments get gradients (the hidden states; the MTP module's
    embeddings too); the rest (rope tables, the mask) are constants of the step.
    ``forward_calls`` counts the twin's forward runs for this layer."""

    def __init__(self, layer: nn.Cell, twin: nn.Cell, grad_inputs: int):
        self.target = layer
        self.twin = twin
        self.grad_inputs = grad_inputs
        self.forward_calls = 0
        names = dict(layer.parameters_and_names())
        mine = dict(twin.parameters_and_names())
        self.binding = TwinBinding(twin, layer)  # untrained parameters, bound state
        self.weights = [p for p in names.values() if p.requires_grad]
        self._twin_weights = [mine[n] for n, p in names.items() if p.requires_grad]

    def load(self, weights) -> None:
        for target, w in zip(self._twin_weights, weights):
            ops.assign(target, w)
        self.binding.load()

    def __call__(self, *args):
        if not grad_recording():
            self.load(self.weights)
            return self.twin(*args)
        return _SharedGraphFunction.apply(self, len(args), *args, *self.weights)


class _SharedGraphFunction(_Function):  # pylint: disable=abstract-method
    @staticmethod
    def forward(ctx, runner, n, *args):  # pylint: disable=arguments-differ
        inputs, weights = args[:n], args[n:]
        runner.load(weights)
        runner.forward_calls += 1
        ctx.runner = runner
        ctx.n = n
        ctx.save_for_backward(*args)
        return runner.twin(*inputs)

    @staticmethod
    def backward(ctx, *douts):  # pylint: disable=arguments-differ
        runner, n = ctx.runner, ctx.n
        saved = ctx.saved_tensors
        inputs, weights = saved[:n], saved[n:]
        runner.load(weights)
        runner.forward_calls += 1
        k = runner.grad_inputs
        rest = inputs[k:]

        def replay(*xs):
            outs = runner.twin(*xs, *rest)
            outs = outs if isinstance(outs, tuple) else (outs,)
            total = None
            for o, d in zip(outs, douts):
                if d is not None and isinstance(o, Tensor) and o.dtype in _FLOATS:
                    term = (o * d).sum()
                    total = term if total is None else total + term
            return total

        gx, gw = ms.grad(replay, grad_position=tuple(range(k)), weights=runner._twin_weights)(*inputs[:k])
        gx = gx if isinstance(gx, tuple) else (gx,)
        return (None, None) + tuple(gx) + (None,) * (n - k) + tuple(gw)
