"""Fully sharded data parallelism (ZeRO-1/2/3) for MindSpore PyNative.

Every parameter is sharded on dim 0 over the shard group (padded to a multiple of the
group size), FSDP2-style, so a shard keeps its parameter's name and number of dims.
The optimizer runs on the shards (:attr:`FSDP.params`) with :attr:`FSDP.grads`.

Strategies (``parallelism.data_parallel_shard_strategy``):

- ``"optim"`` (ZeRO-1): full parameters and full local gradients on every rank; local
  gradients are summed over micro-batches and reduce-scattered once per step.
- ``"optim_grads"`` (ZeRO-2): full parameters; each micro-batch's gradients are
  reduce-scattered at once and only the shard is kept.
- ``"optim_grads_params"`` (ZeRO-3): only shards stay resident. Each unit (a sub-Cell
  named in ``units``) is wrapped in a Cell whose forward all-gathers its parameters,
  runs, and frees them; its custom backward all-gathers them again, recomputes the unit's
  forward under ``ms.grad`` (the PyNative tape cannot keep a freed weight), reduce-scatters
  the weight gradients into the shard accumulators and frees. Parameters outside every
  unit (the "root": embeddings, final norm, head) are gathered for the whole micro-batch.
  ``bucket_bytes``: consecutive units whose full weights fit are gathered (and their
  gradients reduce-scattered) by one collective instead of one each.

  Without reshard after forward (``reshard_after_forward=False``, MindFormers' ``never``) no
  forward is replayed: the units run on the step's own tape with every unit gathered (one
  collective for all) until the backward has finished, and their gradients are
  reduce-scattered after it, ZeRO-2's way.

  Compiled units need nothing special: mindtrain-models' compiled pieces take their weights
  as graph inputs, so the gathered weight swapped in by ``set_data`` is what they compute with.

Gradients are averaged over the group (``reduce_op="avg"``) and summed over
micro-batches, so a loss scaled by ``1 / accumulation_steps`` gives the mean over the
global batch. After the optimizer has updated the shards, call :meth:`FSDP.finish_step`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

from mindtrain.config import ZERO3, ZERO_STRATEGIES
from mindtrain.parallel import collectives as C
from mindtrain.parallel.layout import grad_sq_sums, is_empty
from mindtrain.parallel.mesh import DeviceMesh, Group

STRATEGIES = ZERO_STRATEGIES  # the names live once, in mindtrain.config
_FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


@dataclass
class _Slot:
    """One parameter: its module Parameter, its dim-0 shard and its gradient accumulator."""

    name: str
    param: Parameter
    group: Group
    shape: tuple[int, ...]
    dtype: Any
    rows: int
    local_rows: int
    shard: Parameter
    grad: Optional[Tensor] = None

    @property
    def rest(self) -> tuple[int, ...]:
        return self.shape[1:] if self.shape else ()

    @property
    def shard_numel(self) -> int:
        return self.local_rows * math.prod(self.rest)


@dataclass
class _Bucket:
    """Parameters communicated together: one unit, or the root."""

    name: str
    slots: list[_Slot]
    shared: list[_Slot] = field(default_factory=list)  # root parameters this unit also uses
    gathered: bool = False
    released: bool = False  # its gathered weights' storage released in place (see _Resharded)
    waiting: set = field(default_factory=set)  # its weights whose gradient the backward has not made yet
    # the units gathered with it (itself included), in forward order
    group: list["_Bucket"] = field(default_factory=list, repr=False, compare=False)

    def ahead(self, backward: bool) -> list["_Bucket"]:
        """The units of its group still to run from this one on: those after it (forward),
        or before it (backward), itself included."""
        i = next(k for k, b in enumerate(self.group) if b is self)
        return self.group[:i + 1] if backward else self.group[i:]


class _Kept(nn.Cell):
    """Runs one ZeRO-3 unit whose gathered weights stay until the step's backward is done
    (``reshard_after_forward=False``): gather (a no-op when the step gathered it already),
    forward on the step's tape; its weight gradients are the tape's, no forward replayed."""

    def __init__(self, fsdp: "FSDP", bucket: _Bucket, module: nn.Cell):
        super().__init__()
        self._ctx = [fsdp, bucket, module]  # a list keeps the module's parameters out of ours

    def __getattr__(self, name):
        # Model code reads attributes of its layers (``layer.is_moe``); serve the wrapped one's.
        try:
            return super().__getattr__(name)
        except AttributeError:
            ctx = self.__dict__.get("_ctx")
            if ctx is None:
                raise
            return getattr(ctx[2], name)

    def construct(self, *args):
        fsdp, bucket, module = self._ctx
        fsdp._materialize(bucket)
        return module(*args)


def synchronous_dispatch() -> bool:
    """True when MindSpore runs every op to completion at its call (``ms.runtime.launch_blocking``).
    Releasing a tensor's storage in place is safe only then: with asynchronous dispatch a
    kernel queued before the release may run after it (measured on CPU: ZeRO-3 units releasing
    their weights in place computed wrong losses and gradients, different from run to run)."""
    try:
        from mindspore._c_expression import RuntimeConf  # pylint: disable=import-outside-toplevel
        return bool(RuntimeConf.get_instance().is_launch_blocking())
    except (ImportError, AttributeError):
        return False


class _Arrive(nn.Cell):
    """An identity on a ZeRO-3 unit's outputs whose backward first calls ``action``: the
    gradients reach it before any of the unit's own backward runs (which needs what it
    returns)."""

    def __init__(self, action: Callable[[], None]):
        super().__init__()
        self._action = [action]

    def construct(self, *xs):
        return xs

    def bprop(self, *args):
        self._action[0]()
        return tuple(args[-1])


class _Resharded(_Kept):
    """Runs one ZeRO-3 unit with reshard after forward, on the step's own tape (no forward
    replayed): gather, forward, then release the gathered weights' storage in place
    (``UntypedStorage.resize_(0)``: the views of them the tape keeps for the backward stay
    the same tensors but hold no memory). When the gradients reach the unit's outputs the
    weights are gathered back into that storage (:class:`_Arrive`). Each weight's gradient,
    summed over its uses, reaches FSDP through a hook on its Parameter
    (:meth:`FSDP._grad_hook`: reduce-scattered into the shard, the tape keeping a scalar zero
    in place of the full gradient); once every weight of the unit has had its gradient, its
    storage is released again. (An identity on the unit's inputs would not do for that: its
    backward ran once one input's gradient was complete, before another input's part of the
    unit had run; measured on DeepSeek-V4's MTP module, whose embedding input then read
    released weights.)"""

    def __init__(self, fsdp: "FSDP", bucket: _Bucket, module: nn.Cell):
        super().__init__(fsdp, bucket, module)
        self._arrive = [_Arrive(lambda: fsdp._refill(bucket.ahead(backward=True)))]  # not a sub-cell

    def construct(self, *args):
        fsdp, bucket, module = self._ctx
        fsdp._materialize_all(bucket.ahead(backward=False))
        out = module(*args)
        single = not isinstance(out, tuple)
        out = self._arrive[0](*((out,) if single else out))
        bucket.waiting = {s.name for s in bucket.slots}
        fsdp._release_storage(bucket)
        return out[0] if single else out


class _Unit(_Kept):
    """Runs one ZeRO-3 unit: gather, forward, free; backward by regather and recompute."""

    def construct(self, *args):
        fsdp, bucket, module = self._ctx
        fsdp._materialize_all(bucket.ahead(backward=False))
        out = module(*args)
        fsdp._release(bucket)
        return out

    def bprop(self, *args_out_dout):
        fsdp, bucket, module = self._ctx
        return fsdp._unit_backward(bucket, module, args_out_dout[:-2], args_out_dout[-1])


class FSDP:
    """A model sharded over ``group``; build it with :func:`fully_shard`."""

    def __init__(self, model: nn.Cell, group: Group, units: Sequence[str] = (),
                 strategy: str = ZERO3, shared: Optional[Mapping[str, Sequence[str]]] = None,
                 reduce_op: str = "avg", param_groups: Optional[Mapping[str, Group]] = None,
                 reshard_after_forward: bool = True, replicate: Optional[Group] = None,
                 params: Optional[Sequence[Parameter]] = None, bucket_bytes: int = 0):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"reduce_op must be 'avg' or 'sum', got {reduce_op!r}")
        self.model = model
        self.group = group
        self.strategy = strategy
        self.reduce_op = reduce_op
        self.reshard_after_forward = reshard_after_forward
        self.in_place = strategy == ZERO3 and reshard_after_forward and synchronous_dispatch()
        """ZeRO-3 with reshard after forward, no forward replayed (:class:`_Resharded`): the
        units' gathered weights are released and gathered back in their own storage. Only
        where every op runs to completion at its call (:func:`synchronous_dispatch`; mindtrain
        sets it on CPU); elsewhere each unit's forward is replayed in its backward (:class:`_Unit`)."""
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        """HSDP: the ranks that hold the same shards of the parameters sharded over ``group``
        (not those of ``param_groups``); their reduced gradient shards are averaged (summed
        with ``reduce_op`` "sum") over it."""
        """ZeRO-3: free a unit's gathered weights after its forward (and gather them again for
        its backward); ``False`` keeps them from the forward to the end of the backward."""
        self.peak_gathered_bytes = 0
        self.gather_count = 0
        """Bucket all-gathers run so far (ZeRO-3 forward and backward, ZeRO-1/2 refreshes)."""
        self._gathered_bytes = 0
        self.bucket_bytes = int(bucket_bytes)
        """ZeRO-3 with reshard after forward: consecutive units whose full weights add up to at
        most this many bytes are gathered by one collective (at the first one's forward, and
        again at the last one's backward; each still freed after its own forward and
        backward), and unit gradients are reduce-scattered once this many bytes of them are
        pending; 0: one collective per unit each time."""
        self._pending_root: dict[str, Tensor] = {}
        self._pending_grads: list[tuple[list[_Slot], list[Tensor]]] = []
        self._reduced = True

        # ``params``: the parameters this rank owns (a pipeline stage's), default all of the model's
        named = {p.name: p for p in (model.get_parameters() if params is None else params) if p.requires_grad}
        cells = dict(model.cells_and_names())
        unit_params: dict[str, list[str]] = {}
        for u in units:
            if u not in cells or not u:
                raise ValueError(f"fully_shard: unit {u!r} is not a sub-Cell of the model")
            unit_params[u] = [p.name for p in cells[u].get_parameters()
                              if p.requires_grad and p.name not in (shared or {})]
        owner: dict[str, str] = {}
        for u, names in unit_params.items():
            for name in names:
                if name in owner:
                    raise ValueError(f"fully_shard: parameter {name} is in units {owner[name]} and {u}; "
                                     f"units must not nest or share parameters (use shared=)")
                owner[name] = u
        param_groups = dict(param_groups or {})
        unknown = [n for n in param_groups if n not in named]
        if unknown:
            raise ValueError(f"fully_shard: param_groups names unknown parameters {unknown[:3]}")
        self.slots: dict[str, _Slot] = {name: self._make_slot(name, p, param_groups.get(name, group))
                                        for name, p in named.items()}
        self.units = [_Bucket(u, [self.slots[n] for n in unit_params[u]]) for u in units]
        root = [s for name, s in self.slots.items() if name not in owner]
        self.root = _Bucket("<root>", root, gathered=True)
        for pname, users in (shared or {}).items():
            if pname not in self.slots:
                raise ValueError(f"fully_shard: shared parameter {pname} is not a trainable parameter")
            for u in users:
                bucket = next((b for b in self.units if b.name == u), None)
                if bucket is None:
                    raise ValueError(f"fully_shard: shared parameter {pname} names unknown unit {u!r}")
                bucket.shared.append(self.slots[pname])
        self._buckets = [self.root] + self.units
        unit_bytes = [sum(_nbytes_of(s) for s in b.slots) for b in self.units]
        for lo, hi in _batches(unit_bytes, self.bucket_bytes):
            for b in self.units[lo:hi]:
                b.group = self.units[lo:hi]
        if strategy == ZERO3:
            for bucket in self.units:
                self._wrap(cells, bucket)
                if self.in_place:
                    for slot in bucket.slots:
                        slot.param.register_hook(self._grad_hook(slot, bucket))
            for s in self.slots.values():  # only the shards stay: the full weights are gathered when used
                s.param.set_data(ops.zeros((0,), s.dtype))
            self.root.gathered = False
        else:
            for bucket in self._buckets:
                bucket.gathered = True
            self._gathered_bytes = sum(_nbytes(s.param) for s in self.slots.values())
            self.peak_gathered_bytes = self._gathered_bytes

    # ---- construction --------------------------------------------------------------------
    @staticmethod
    def _make_slot(name: str, p: Parameter, group: Group) -> _Slot:
        shape = tuple(p.shape)
        rows = shape[0] if shape else 1
        local_rows = -(-rows // group.size)
        if is_empty(p):  # a model built empty: the shard's values come with load_shards
            mine = np.zeros((local_rows,) + shape[1:], np.float32)
        else:
            full = p.asnumpy().reshape((rows,) + shape[1:])
            pad = np.zeros((local_rows * group.size,) + shape[1:], full.dtype)
            pad[:rows] = full
            mine = pad[group.index * local_rows:(group.index + 1) * local_rows]
        shard = Parameter(Tensor(np.ascontiguousarray(mine)), name=name, requires_grad=False)
        return _Slot(name, p, group, shape, p.dtype, rows, local_rows, shard)

    def _wrap(self, cells: dict, bucket: _Bucket) -> None:
        path = bucket.name
        parent_path, _, key = path.rpartition(".")
        parent = cells[parent_path] if parent_path else self.model
        wrapper = (_Kept if not self.reshard_after_forward else _Resharded if self.in_place else _Unit)(
            self, bucket, cells[path])
        if isinstance(parent, (nn.CellList, nn.SequentialCell)) and key.isdigit():
            parent[int(key)] = wrapper
        else:
            setattr(parent, key, wrapper)

    # ---- public API ------------------------------------------------------------------------
    @property
    def params(self) -> list[Parameter]:
        """Local shards, for the optimizer (names and ndim as in the model)."""
        return [s.shard for s in self.slots.values()]

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [(name, s.shard) for name, s in self.slots.items()]

    @property
    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: s.shape for name, s in self.slots.items()}

    @property
    def grads(self) -> list[Tensor]:
        """Reduced gradient shards aligned with :attr:`params` (zeros before any backward)."""
        self.reduce_gradients()
        return [s.grad if s.grad is not None else ops.zeros(s.shard.shape, s.shard.dtype)
                for s in self.slots.values()]

    def value_and_grad(self, fn: Callable, has_aux: bool = False) -> Callable:
        """Wrap ``fn(*args) -> loss`` (or ``(loss, aux)``); each call runs forward and backward
        for one micro-batch, accumulates the gradient shards and returns what ``fn`` returns."""
        zero3 = self.strategy == ZERO3
        kept = zero3 and not self.reshard_after_forward
        if zero3:
            # the units run on the step's tape: their weights are differentiated there too
            # (with reshard after forward their gradients leave through hooks, as they come)
            unit_slots = [s for b in self.units for s in b.slots]
            slots = self.root.slots + (unit_slots if kept else [])
            hooked = unit_slots if self.in_place else []
        else:
            slots = list(self.slots.values())
            hooked = []
        weights = [s.param for s in slots + hooked]
        grad_fn = ms.value_and_grad(fn, grad_position=None if weights else 0, weights=weights or None,
                                    has_aux=has_aux)

        def step(*args):
            if kept:  # everything stays gathered to the end of the backward: gather it at once
                self._materialize_all(self._buckets)
            elif zero3:
                self._materialize(self.root)
            value, grads = grad_fn(*args)
            grads = tuple(grads)[:len(slots)] if weights else ()  # the hooked ones came through hooks
            self._flush_grads()
            if zero3:
                self._release(self.root)
                for bucket in self.units:  # without reshard: every unit is still gathered
                    self._release(bucket)
            if kept:  # reduce-scattered in batches of about _RS_BYTES, not all at once
                grads = list(grads)
                for lo, hi in _batches([_nbytes_of(s) for s in slots], _RS_BYTES):
                    self._accumulate(slots[lo:hi], grads[lo:hi])
            else:
                self._accumulate(slots, list(grads))
            return value

        return step

    def forward(self, fn: Callable) -> Callable:
        """Wrap ``fn(*args)`` to run forward only (an evaluation): under ZeRO-3 the weights
        outside the units are gathered for the call and every unit's freed after it; no
        gradient is made or touched."""

        def call(*args):
            if self.strategy != ZERO3:
                return fn(*args)
            self._materialize(self.root)
            try:
                return fn(*args)  # outside a grad function nothing is recorded
            finally:
                self._release(self.root)
                for bucket in self.units:  # without reshard_after_forward a unit stays gathered
                    self._release(bucket)

        return call

    def reduce_gradients(self) -> None:
        """ZeRO-1: reduce the step's summed local gradients (no-op for the other strategies)."""
        if self._reduced:
            return
        for bucket in self._buckets:
            full = [s.grad for s in bucket.slots]
            if any(g is None for g in full):
                full = [g if g is not None else ops.zeros(s.shape, s.dtype) for s, g in zip(bucket.slots, full)]
            for s, g in zip(bucket.slots, self._reduce_scatter(bucket.slots, full)):
                s.grad = g
        self._reduced = True

    def grad_sq_sums(self) -> dict[Group, float]:
        """Sum of squared gradients per shard group, each summed over its group.

        With only FSDP the total is the squared global norm. Pieces that other ranks hold
        outside FSDP (experts on other EP ranks, TP shards) must still be summed over those
        groups by the caller before taking the root, then passed to ``clip_grad_norm(norm=)``.
        """
        return grad_sq_sums(self.grads, [s.group for s in self.slots.values()])

    def grad_norm(self) -> float:
        """L2 norm of the whole (unsharded) gradient, over all shards."""
        return float(math.sqrt(sum(self.grad_sq_sums().values())))

    def clip_grad_norm(self, max_norm: float, norm: Optional[float] = None) -> float:
        """Scale gradients so that the global norm (``norm``, by default :meth:`grad_norm`)
        is at most ``max_norm``; returns the norm before clipping (the coefficient is
        torch's: max_norm / (norm + 1e-6))."""
        norm = self.grad_norm() if norm is None else float(norm)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for s in self.slots.values():
                if s.grad is not None:
                    s.grad = s.grad * coef
        return norm

    def gather_params(self) -> None:
        """Gather the full parameters outside every unit (all of them without units) until
        :meth:`free_params`: for a caller that runs several forwards and backwards of the
        same weights in a row (a pipeline stage's micro-batches). A no-op while gathered."""
        self._materialize(self.root)

    def free_params(self) -> None:
        """Free what :meth:`gather_params` gathered (ZeRO-3 keeps only the shards)."""
        self._release(self.root)

    def reduce_scatter(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """This rank's shards of full gradients aligned with :attr:`params`, reduced over the
        group (``reduce_op``), without accumulating them."""
        return self._reduce_scatter(list(self.slots.values()), list(grads))

    def zero_grad(self) -> None:
        for s in self.slots.values():
            s.grad = None
        self._pending_root.clear()
        self._reduced = True

    def finish_step(self) -> None:
        """After the optimizer updated :attr:`params`: refresh full parameters (ZeRO-1/2) and
        drop the gradients."""
        if self.strategy != ZERO3:
            for bucket in self._buckets:
                self._materialize(bucket, force=True)
        self.zero_grad()

    # ---- full (unsharded) state ---------------------------------------------------------------
    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter at full shape, on every rank."""
        names = list(self.slots)
        return dict(zip(names, self.gather_full([self.slots[n].shard for n in names], names)))

    def load_full_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load full parameters (from any data-parallel degree) into the shards."""
        missing = [n for n in self.slots if n not in state]
        if missing:
            raise KeyError(f"load_full_state_dict: missing {', '.join(missing[:5])}")
        for name, shard in zip(self.slots, self.shard_full([state[n] for n in self.slots], list(self.slots))):
            self.slots[name].shard.set_data(shard)
        for bucket in self._buckets:
            if self.strategy != ZERO3:
                self._materialize(bucket, force=True)
        self.zero_grad()

    def gather_full(self, tensors: Sequence[Tensor], names: Optional[Sequence[str]] = None) -> list[np.ndarray]:
        """Full arrays from shard-shaped tensors (e.g. optimizer moments) aligned with ``names``
        (default: :attr:`params` order)."""
        names = list(self.slots) if names is None else list(names)
        slots = [self.slots[n] for n in names]
        out = self._all_gather(slots, list(tensors))
        return [o.asnumpy() for o in out]

    def shard_full(self, arrays: Sequence[Any], names: Optional[Sequence[str]] = None) -> list[Tensor]:
        """This rank's shards of full arrays aligned with ``names`` (default: :attr:`params`)."""
        names = list(self.slots) if names is None else list(names)
        result = []
        for name, a in zip(names, arrays):
            s = self.slots[name]
            a = a.asnumpy() if isinstance(a, Tensor) else np.asarray(a)
            if tuple(a.shape) != s.shape:
                raise ValueError(f"{name}: full shape {tuple(a.shape)} != model shape {s.shape}")
            a = a.reshape((s.rows,) + s.rest)
            pad = np.zeros((s.local_rows * s.group.size,) + s.rest, a.dtype)
            pad[:s.rows] = a
            i = s.group.index
            result.append(Tensor(np.ascontiguousarray(pad[i * s.local_rows:(i + 1) * s.local_rows])))
        return result

    def narrow(self, name: str, offset: list, shape: list) -> None:
        """Narrow the box ``offset``/``shape`` (full coordinates of the parameter as the model
        holds it) to this rank's dim-0 shard; past the last row the box is empty."""
        s = self.slots[name]
        if not shape:
            raise ValueError(f"{name}: a 0-d parameter has no dim-0 shard box")
        start = min(s.group.index * s.local_rows, s.rows)
        offset[0] += start
        shape[0] = min(s.local_rows, s.rows - start)

    def load_shards(self, shards: Iterable[np.ndarray], names: Sequence[str]) -> None:
        """Write this rank's shard arrays (shard-shaped, padding included) of ``names`` and
        refresh the full parameters kept gathered (ZeRO-1/2: a collective)."""
        for name, a in zip(names, shards):
            self.slots[name].shard.set_data(Tensor(np.ascontiguousarray(a)))
        if self.strategy != ZERO3:
            for bucket in self._buckets:
                self._materialize(bucket, force=True)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: shards + materialized full parameters, and gradients."""
        params = sum(_nbytes(s.shard) + _nbytes(s.param) for s in self.slots.values())
        grads = sum(_nbytes(s.grad) for s in self.slots.values() if s.grad is not None)
        return {"params": params, "grads": grads}

    # ---- internals ------------------------------------------------------------------------
    def _materialize(self, bucket: _Bucket, force: bool = False) -> None:
        if bucket.gathered and not force:
            return
        fulls = self._all_gather(bucket.slots, [s.shard for s in bucket.slots])
        self.gather_count += 1
        for s, full in zip(bucket.slots, fulls):
            if bucket.gathered and tuple(s.param.shape) == s.shape and not is_empty(s.param):
                # a resident full parameter (ZeRO-1/2): write its buffer in place, no new storage
                ops.assign(s.param, full)
            else:
                s.param.set_data(full)
        if not bucket.gathered:
            self._gathered_bytes += sum(_nbytes(s.param) for s in bucket.slots)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        bucket.gathered = True

    def _release_storage(self, bucket: _Bucket) -> None:
        """Release the storage of ``bucket``'s gathered weights in place (dispatch is
        synchronous: no kernel still reads it); the tape's views of them keep their shape, not
        their memory."""
        if not bucket.gathered:
            return
        self._gathered_bytes -= sum(_nbytes(s.param) for s in bucket.slots)
        for s in bucket.slots:
            s.param.untyped_storage().resize_(0)
        bucket.gathered = False
        bucket.released = True

    def _refill(self, buckets: Sequence[_Bucket]) -> None:
        """Gather the weights of ``buckets`` back into the storage :meth:`_release_storage`
        released (one all_gather per shard group for all of them)."""
        self._gather_buckets([b for b in buckets if b.released and not b.gathered], in_place=True)

    def _grad_hook(self, slot: _Slot, bucket: _Bucket):
        """The hook on a unit weight's Parameter: its gradient (summed over its uses: MindSpore
        calls the hook once, after the last) goes to the pending reduce-scatter and the tape
        keeps a scalar zero; the unit's last weight releases the unit's storage."""

        def hook(grad):
            self._pend_grads([slot], [grad])
            bucket.waiting.discard(slot.name)
            if not bucket.waiting:
                self._release_storage(bucket)
            return ops.zeros((), grad.dtype)

        return hook

    def _pend_grads(self, slots: list[_Slot], grads: list) -> None:
        """Queue unit gradients for the reduce-scatter; flush once ``bucket_bytes`` of them wait."""
        self._pending_grads.append((slots, grads))
        if sum(_nbytes_of(s) for pending, _ in self._pending_grads for s in pending) >= self.bucket_bytes:
            self._flush_grads()

    def _flush_grads(self) -> None:
        """Reduce-scatter the unit gradients the backward left pending, in one collective per
        shard group."""
        if self._pending_grads:
            pending, self._pending_grads = self._pending_grads, []
            self._accumulate([s for slots, _ in pending for s in slots], [g for _, gs in pending for g in gs])

    def _materialize_all(self, buckets: Sequence[_Bucket]) -> None:
        """Gather every bucket of ``buckets`` not gathered yet, with one all_gather per shard
        group for all of them."""
        self._gather_buckets([b for b in buckets if not b.gathered], in_place=False)

    def _gather_buckets(self, todo: Sequence[_Bucket], in_place: bool) -> None:
        """All-gather the full weights of ``todo`` (one collective per shard group) into their
        Parameters: new storage (``set_data``), or ``in_place`` into the storage they had."""
        if not todo:
            return
        slots = [s for b in todo for s in b.slots]
        fulls = self._all_gather(slots, [s.shard for s in slots])
        self.gather_count += len(todo)
        for s, full in zip(slots, fulls):
            if in_place:
                storage = s.param.untyped_storage()
                storage.resize_(full.untyped_storage().nbytes())
                storage.copy_(full.untyped_storage())
            else:
                s.param.set_data(full)
        for b in todo:
            b.gathered = True
            b.released = False
        self._gathered_bytes += sum(_nbytes(s.param) for s in slots)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)

    def _release(self, bucket: _Bucket) -> None:
        if bucket.released:  # storage released in place: drop the empty full-shape tensors too
            for s in bucket.slots:
                s.param.set_data(ops.zeros((0,), s.dtype))
            bucket.released = False
        if not bucket.gathered:
            return
        self._gathered_bytes -= sum(_nbytes(s.param) for s in bucket.slots)
        for s in bucket.slots:
            s.param.set_data(ops.zeros((0,), s.dtype))
        bucket.gathered = False

    def _all_gather(self, slots: list[_Slot], shards: list[Tensor]) -> list[Tensor]:
        """Full tensors of ``slots`` from their shard-shaped ``shards``: one all_gather per
        shard group."""
        out: list[Optional[Tensor]] = [None] * len(slots)
        for grp, idx in _by_group(slots).items():
            xp = _Arrays.of(grp, [slots[i] for i in idx])
            flat = xp.cat([xp.flat(shards[i]) for i in idx])
            if xp.host:
                for i, full in zip(idx, _host_gather(flat, grp, [slots[i] for i in idx])):
                    out[i] = full
                continue
            table = xp.all_gather(flat, grp)
            for i, s, off in _columns(slots, idx):
                part = table[:, off:off + s.shard_numel].reshape((s.local_rows * grp.size,) + s.rest)
                out[i] = xp.owned(part[:s.rows].reshape(s.shape))
        return out

    def _reduce_scatter(self, slots: list[_Slot], fulls: list[Tensor]) -> list[Tensor]:
        """Shards of the group-reduced ``fulls``: one reduce_scatter per shard group."""
        out: list[Optional[Tensor]] = [None] * len(slots)
        for grp, idx in _by_group(slots).items():
            n = grp.size
            xp = _Arrays.of(grp, [slots[i] for i in idx])
            cols = []
            for i in idx:
                s = slots[i]
                g = xp.array(fulls[i]).reshape((s.rows,) + s.rest)
                if s.local_rows * n != s.rows:  # pad to whole shards
                    g = xp.cat([g, xp.zeros((s.local_rows * n - s.rows,) + s.rest, g.dtype)])
                cols.append(g.reshape(n, -1))
            mine = xp.reduce_scatter(xp.cat(cols, axis=1), grp, self.reduce_op)
            if self.replicate is not None and grp == self.group:
                mine = self._across_replicas(mine)
            for i, s, off in _columns(slots, idx):
                out[i] = xp.result(mine[off:off + s.shard_numel].reshape((s.local_rows,) + s.rest))
        return out

    def _across_replicas(self, flat):
        """HSDP: a group's reduced flat gradient shards reduced again over the replicas."""
        host = isinstance(flat, np.ndarray)
        total = C.all_reduce(Tensor(np.ascontiguousarray(flat)) if host else flat, self.replicate)
        if self.reduce_op == "avg":
            total = total / float(self.replicate.size)
        return total.asnumpy() if host else total

    def _accumulate(self, slots: list[_Slot], grads: list[Tensor]) -> None:
        for s in slots:
            extra = self._pending_root.pop(s.name, None)
            if extra is not None:
                i = slots.index(s)
                grads[i] = grads[i] + extra
        if self.strategy == "optim":
            for s, g in zip(slots, grads):
                s.grad = g if s.grad is None else s.grad + g
            self._reduced = False
            return
        for s, g in zip(slots, self._reduce_scatter(slots, grads)):
            s.grad = g if s.grad is None else s.grad + g

    def _unit_backward(self, bucket: _Bucket, module: nn.Cell, args: tuple, dout) -> tuple:
        """The unit's input gradients; its weights' gradients go to their shards.

        The forward runs again on the gathered weights. A module with a functional form
        (``module.functional()`` -> ``(fn, weights)``: ``fn(*inputs, *values)`` computes the
        module on ``values`` in place of ``weights``) is differentiated in its inputs and the
        weights' values, which keeps no state per Parameter in MindSpore's compiled graphs;
        any other module by ``ms.grad(weights=...)``."""
        douts = dout if isinstance(dout, tuple) else (dout,)
        self._materialize_all(bucket.ahead(backward=True))  # backward runs them last to first
        weights = [s.param for s in bucket.slots] + [s.param for s in bucket.shared]
        form = getattr(module, "functional", None)
        form = form() if form is not None else None
        fn, inner = form if form is not None else (module, ())

        def replay(*xs):
            outs = fn(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            total = None
            for o, d in zip(outs, douts):
                if isinstance(o, Tensor) and o.dtype in _FLOATS:
                    term = (o * d).sum()
                    total = term if total is None else total + term
            return total

        n = len(args)
        if form is not None:
            values = [w.view(w.shape) for w in inner]  # views: no copy of the gathered weights
            grads = ms.grad(replay, grad_position=tuple(range(n + len(values))))(*args, *values)
            gx, of = grads[:n], {id(w): g for w, g in zip(inner, grads[n:])}
            gw = [of[id(w)] if id(w) in of else ops.zeros(w.shape, w.dtype) for w in weights]
        else:
            gx, gw = ms.grad(replay, grad_position=tuple(range(n)), weights=weights)(*args)
        self._release(bucket)
        k = len(bucket.slots)
        self._pend_grads(bucket.slots, list(gw[:k]))
        for s, g in zip(bucket.shared, gw[k:]):
            prev = self._pending_root.get(s.name)
            self._pending_root[s.name] = g if prev is None else prev + g
        return gx if isinstance(gx, tuple) else (gx,)


_RS_BYTES = 64 << 20
"""Gradients reduce-scattered together after a step's backward without reshard after forward:
about this many bytes of full gradients per collective (Megatron's buckets are ~40M values)."""


def _nbytes_of(s: _Slot) -> int:
    return math.prod(s.shape) * np.dtype(ms.dtype_to_nptype(s.dtype)).itemsize


def _batches(sizes: Sequence[int], cap: int):
    """``(lo, hi)`` index ranges covering ``sizes`` in order, each summing to at most ``cap``
    (or one item larger than it)."""
    lo, total = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and total + n > cap:
            yield lo, i
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        yield lo, len(sizes)


def _host_gather(flat: np.ndarray, grp, slots: list) -> list[Tensor]:
    """The full tensors of ``slots`` from every member's flat bucket ``flat`` (their shards
    back to back), each piece of the shared-memory all_gather written straight into its
    slot's full array: no stacked table and no copy of it (a 200 MB unit's gather held
    three copies of its weights at once before)."""
    n = grp.size
    fulls = [np.empty((s.local_rows * n,) + s.rest, flat.dtype) for s in slots]
    rows = [f.reshape(n, -1) for f in fulls]    # member r's shard is row r
    starts = np.cumsum([0] + [s.shard_numel for s in slots])

    def sink(a: int, b: int, table: np.ndarray) -> None:
        for k in range(len(slots)):
            lo, hi = max(a, starts[k]), min(b, starts[k + 1])
            if lo < hi:
                rows[k][:, lo - starts[k]:hi - starts[k]] = table[:, lo - a:hi - a]

    C.host_all_gather(flat, grp, sink=sink)
    return [Tensor.from_numpy(f[:s.rows].reshape(s.shape)) for s, f in zip(slots, fulls)]


def _columns(slots: list, idx: list[int]):
    """(index, slot, offset) of each slot's column block in a group's flat bucket."""
    off = 0
    for i in idx:
        yield i, slots[i], off
        off += slots[i].shard_numel


class _Arrays:
    """The array operations a bucket's gather and reduce-scatter need: on the host (numpy
    slicing around the shared-memory transport) or on the device (MindSpore ops around its
    collectives). The bucket layout rule is written once, in FSDP, over these."""

    def __init__(self, host: bool):
        self.host = host

    @classmethod
    def of(cls, grp, slots: list) -> "_Arrays":
        return cls(C.on_host(grp, slots[0].dtype) and len({s.dtype for s in slots}) == 1)

    def array(self, t: Tensor):
        return t.asnumpy() if self.host else t

    def flat(self, t: Tensor):
        return self.array(t).reshape(-1)

    def cat(self, parts: list, axis: int = 0):
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts, axis=axis) if self.host else mint.cat(parts, dim=axis)

    def zeros(self, shape: tuple, dtype):
        return np.zeros(shape, dtype) if self.host else mint.zeros(shape, dtype=dtype)

    def all_gather(self, flat, grp):
        """(group size, flat size) table of every member's ``flat``."""
        return C.host_all_gather(flat, grp) if self.host else C.all_gather(flat, grp).reshape(grp.size, -1)

    def reduce_scatter(self, table, grp, op: str):
        return C.host_reduce_scatter(table, grp, op=op) if self.host else C.reduce_scatter(table.reshape(-1), grp, op=op)

    def owned(self, part) -> Tensor:
        """A tensor with its own storage (a gathered parameter outlives the table)."""
        return Tensor(np.ascontiguousarray(part)) if self.host else ops.deepcopy(part)

    def result(self, part) -> Tensor:
        # host: a Tensor over the reduce-scatter's own output (Tensor(array) would copy it)
        return Tensor.from_numpy(np.ascontiguousarray(part)) if self.host else part


def _by_group(slots: Sequence[_Slot]) -> dict[Group, list[int]]:
    groups: dict[Group, list[int]] = {}
    for i, s in enumerate(slots):
        groups.setdefault(s.group, []).append(i)
    return groups


def _nbytes(t: Optional[Tensor]) -> int:
    return 0 if t is None else int(t.size) * t.itemsize


def fully_shard(model: nn.Cell, mesh_or_group, units: Sequence[str] = (),
                strategy: str = ZERO3, shared: Optional[Mapping[str, Sequence[str]]] = None,
                reduce_op: str = "avg", dim: str = "dp",
                param_groups: Optional[Mapping[str, Any]] = None, reshard_after_forward: bool = True,
                replicate: Any = None, params: Optional[Sequence[Parameter]] = None,
                bucket_bytes: int = 0) -> FSDP:
    """Shard ``model``'s trainable parameters over the mesh's ``dim`` group (or a Group).

    ``units``: sub-Cell paths (as in ``model.cells_and_names()``, e.g. a plan unit's ``path``)
    gathered one at a time under ZeRO-3; each unit's inputs must be Tensors and its forward
    deterministic (it is recomputed in backward). ``shared``: parameter name -> units whose
    forward uses it; such a parameter stays in the root (gathered for the whole
    micro-batch) even if it lives inside a unit, for weights used both inside and outside
    a unit (a tied embedding used by an MTP unit, an MTP norm applied by the shared head).
    ``param_groups``: parameter name -> Group (or mesh dimension name) to shard that
    parameter over instead, e.g. routed experts over ``"edp"`` when EP splits them.
    ``reshard_after_forward`` (ZeRO-3): ``True`` frees each unit's weights after its forward
    and gathers them again for its backward (less memory, twice the all-gathers); ``False``
    keeps them gathered until the unit's backward (MindFormers' ``"never"`` policy).
    ``replicate`` (a Group or mesh dimension name; HSDP): ranks holding the same shards of the
    parameters sharded over ``dim``; their gradients are reduced over it too.
    ``params``: shard only these parameters of ``model`` (what one pipeline stage owns).
    ``bucket_bytes`` (ZeRO-3 with reshard after forward): consecutive units of at most this
    many bytes of full weights are gathered by one collective and their gradients
    reduce-scattered by one (see :attr:`FSDP.bucket_bytes`); the peak then holds such a group
    instead of one unit. 0: one unit at a time.
    """
    mesh = mesh_or_group if isinstance(mesh_or_group, DeviceMesh) else None
    group = mesh.group(dim) if mesh is not None else mesh_or_group
    overrides = {}
    for name, g in (param_groups or {}).items():
        if isinstance(g, str):
            if mesh is None:
                raise ValueError("fully_shard: param_groups by dimension name need a DeviceMesh")
            g = mesh.group(g)
        overrides[name] = g
    if isinstance(replicate, str):
        if mesh is None:
            raise ValueError("fully_shard: replicate by dimension name needs a DeviceMesh")
        replicate = mesh.group(replicate)
    return FSDP(model, group, units, strategy, shared, reduce_op, overrides, reshard_after_forward, replicate,
                params, bucket_bytes)
