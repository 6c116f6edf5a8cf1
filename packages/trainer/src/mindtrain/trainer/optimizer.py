"""AdamW with decoupled weight decay and bias correction, as torch.optim.AdamW computes it."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from mindtrain.config import OptimizerConfig
from mindtrain.parallel import synchronous_dispatch


def wants_decay(name: str, param: Parameter) -> bool:
    """Weight decay applies to matrices only: not to norms, biases or any 1-D parameter."""
    lowered = name.lower()
    return len(param.shape) >= 2 and not lowered.endswith("bias") and "norm" not in lowered


class _FlatGroup:
    """Parameters of one dtype and one weight-decay setting as pieces of one contiguous buffer
    (Megatron's contiguous parameter buffers): each Parameter holds a view of ``flat`` (what
    the model and its compiled layers read), each moment a view of ``exp_avg`` /
    ``exp_avg_sq``; the update is one kernel call over the whole buffer."""

    def __init__(self, idx: list[int], params: list[Parameter], decay: bool):
        self.idx = idx
        self.decay = decay
        self.params = params
        self.sizes = [int(p.size) for p in params]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        total = self.offsets[-1]
        tag = f"{'decay' if decay else 'no_decay'}.{params[0].dtype}"
        self.flat = Parameter(Tensor(np.zeros(1, np.float32)).astype(params[0].dtype),  # adopt() fills it
                              name=f"flat_params.{tag}", requires_grad=False)
        self.exp_avg = Parameter(Tensor(np.zeros(total, np.float32)), name=f"flat_exp_avg.{tag}", requires_grad=False)
        self.exp_avg_sq = Parameter(Tensor(np.zeros(total, np.float32)), name=f"flat_exp_avg_sq.{tag}",
                                    requires_grad=False)
        self._grad_host: Optional[np.ndarray] = None  # host_gradient's buffer
        self.m_views = [self._piece(self.exp_avg, i, f"exp_avg.{p.name}") for i, p in enumerate(params)]
        self.v_views = [self._piece(self.exp_avg_sq, i, f"exp_avg_sq.{p.name}") for i, p in enumerate(params)]
        self._ptrs: list[int] = []
        self.adopt()

    def _piece(self, buf: Parameter, i: int, name: str) -> Parameter:
        view = Parameter(Tensor(np.zeros(1, np.float32)), name=name, requires_grad=False)
        view.set_data(self._view(buf, i))
        return view

    def _view(self, buf: Parameter, i: int) -> Tensor:
        return buf[self.offsets[i]:self.offsets[i + 1]].view(tuple(self.params[i].shape))

    def adopt(self) -> None:
        """Copy the parameters' current values into the buffer and make each a view of it
        again (at the start, and after anything gave a parameter new storage: a checkpoint
        load's ``set_data``, an FSDP shard refreshed)."""
        values = np.concatenate([p.asnumpy().reshape(-1) for p in self.params])
        self.flat.set_data(Tensor(values))
        for i, p in enumerate(self.params):
            p.set_data(self._view(self.flat, i))
        self._ptrs = [p.data_ptr() for p in self.params]

    def flat_gradient(self, grads: list) -> Tensor:
        """The group's gradients as one flat tensor in the buffer's dtype (``ops.cat``)."""
        dtype = self.flat.dtype
        return ops.cat([(x if x.dtype == dtype else x.astype(dtype)).reshape(-1) for x in grads])

    def host_gradient(self, grads: list, scale: float) -> Tensor:
        """The host route's flat gradient (float32 ``grads``, :meth:`host_ready`, on a CPU
        device with synchronous dispatch: a kernel has finished reading the tensor before
        the next step writes it): copied with numpy, times ``scale`` in the same pass, into a
        host buffer kept between steps and handed over without a copy (``Tensor.from_numpy``);
        a fresh 24 MB buffer each step page-faults (bench model: ``ops.cat`` 10.4 ms,
        ``np.concatenate`` into the kept buffer 1.8 ms)."""
        if self._grad_host is None:
            self._grad_host = np.empty(self.offsets[-1], np.float32)
        if scale == 1.0:
            np.concatenate([x.asnumpy().reshape(-1) for x in grads], out=self._grad_host)
        else:
            factor = np.float32(scale)
            for x, a, b in zip(grads, self.offsets, self.offsets[1:]):
                np.multiply(x.asnumpy().reshape(-1), factor, out=self._grad_host[a:b])
        return Tensor.from_numpy(self._grad_host)

    def host_ready(self, grads: list) -> bool:
        """True when the buffer and ``grads`` are float32 (the host update's precondition)."""
        return self.flat.dtype == ms.float32 and all(x.dtype == ms.float32 for x in grads)

    def decay_in_place(self, factor: float) -> None:
        """The buffer times ``factor`` (AdamW's decoupled decay, ``1 - lr * wd``) in place: a
        numpy pass over the buffer's own memory (``asnumpy`` on a CPU device shares it; a
        MindSpore multiply would write a fresh buffer and copy it back). The host route only."""
        values = self.flat.asnumpy()
        if not (values.flags.writeable and values.ctypes.data == self.flat.data_ptr()):
            raise RuntimeError("AdamW's host route needs the buffer's own memory from asnumpy (a CPU device)")
        np.multiply(values, np.float32(factor), out=values)

    def aliased(self) -> bool:
        """True while every parameter is still its piece of the buffer."""
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self._ptrs))

    def moments_aliased(self) -> bool:
        base_m, base_v = self.exp_avg.data_ptr(), self.exp_avg_sq.data_ptr()
        item = self.exp_avg.itemsize
        return all(m.data_ptr() == base_m + o * item and v.data_ptr() == base_v + o * item
                   for m, v, o in zip(self.m_views, self.v_views, self.offsets))

    def load_moments(self, m: list[np.ndarray], v: list[np.ndarray]) -> None:
        self.exp_avg.set_data(Tensor(np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in m])))
        self.exp_avg_sq.set_data(Tensor(np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in v])))
        for i in range(len(self.params)):
            self.m_views[i].set_data(self._view(self.exp_avg, i))
            self.v_views[i].set_data(self._view(self.exp_avg_sq, i))


class AdamW:
    """AdamW over a list of named parameters.

    The update in one pass (issue 33): the parameters of one dtype and weight-decay setting
    are pieces of contiguous buffers of at most :data:`BUCKET_ELEMENTS` values (each
    Parameter a view of one, each moment a view of a moment buffer); per step the gradients
    of a buffer are concatenated into one flat gradient and MindSpore's fused
    ``ops.FusedCastAdamWeightDecay`` kernel runs once per buffer: it reads the gradient, divides it by its ``global_norm`` input (gradient
    clipping: ``1 / grad_scale``, so no separate pass scales the gradients), updates both
    moments and writes the weights in place (the buffer the model's layers read, through
    their views). The kernel has no bias correction of its own; folding the corrections
    into its scalar arguments (lr * sqrt(bc2) / bc1, eps * sqrt(bc2), wd * bc1 / sqrt(bc2))
    gives torch's update exactly in real arithmetic.

    On a CPU device with synchronous dispatch (the trainer's CPU runtime) a float32 buffer
    takes another route, because the fused kernel runs one thread there (22 ms for 6.0M
    values, torch's fused AdamW 2.8 ms): the gradients are copied once into a kept host
    buffer times the clipping coefficient, the decay (``1 - lr * wd``, torch's) is one numpy
    pass over the weights' own memory, and ``ops.Adam`` (ApplyAdam, 3.6 ms) does the Adam
    step with the bias correction in its ``beta_power`` inputs and ``eps * sqrt(bc2)``.

    A parameter given new storage since the last step (``set_data``: a checkpoint load, an
    FSDP shard written anew) is noticed by its data pointer and its group's buffer is made
    again from the current values. ``flat=False``: one kernel call per parameter, the
    update before (benchmarks compare both). Zero-size pieces (an FSDP shard past the last
    row) are skipped: the kernel refuses them.

    Bench model (63 tensors, 6.0M values, CPU time on a busy 2-core machine): 37-40 ms per
    update against 49-58 ms for one call per parameter (``benchmarks/bench_model.py
    --update-ab``; ``benchmarks/RESULTS.md``, 2026-12-04).
    """

    def __init__(self, named_params: Sequence[tuple[str, Parameter]], lr: float = 1e-3,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 no_decay: Optional[Iterable[str]] = None, flat: bool = True):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.lr = float(lr)
        self.beta1, self.beta2 = (float(b) for b in betas)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        skip = set(no_decay) if no_decay is not None else {
            n for n, p in named_params if not wants_decay(n, p)}
        self.decay = [n not in skip for n in self.names]
        self.step_count = 0
        self._kernel = ops.FusedCastAdamWeightDecay()
        self._adam = ops.Adam()  # ApplyAdam: the host route's Adam step (decay applied before it)
        self._betas = (Tensor(self.beta1, ms.float32), Tensor(self.beta2, ms.float32))
        self._no_decay = Tensor(0.0, ms.float32)
        self._groups: list[_FlatGroup] = []
        self._loose = list(range(len(self.params)))  # updated one kernel call each
        if flat:
            keyed: dict = {}
            for i, p in enumerate(self.params):
                if p.size > 0 and _has_storage(p):
                    keyed.setdefault((str(p.dtype), self.decay[i]), []).append(i)
            for (_, decay), idx in keyed.items():
                for bucket in _buckets(idx, [int(self.params[i].size) for i in idx]):
                    self._groups.append(_FlatGroup(bucket, [self.params[i] for i in bucket], decay))
            grouped = {i for g in self._groups for i in g.idx}
            self._loose = [i for i in range(len(self.params)) if i not in grouped]
        self.exp_avg: list = [None] * len(self.params)
        self.exp_avg_sq: list = [None] * len(self.params)
        for g in self._groups:
            for i, m, v in zip(g.idx, g.m_views, g.v_views):
                self.exp_avg[i], self.exp_avg_sq[i] = m, v
        for i in self._loose:
            self.exp_avg[i] = self._zeros(self.params[i], "exp_avg")
            self.exp_avg_sq[i] = self._zeros(self.params[i], "exp_avg_sq")

    @staticmethod
    def _zeros(p: Parameter, kind: str) -> Parameter:
        return Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"{kind}.{p.name}", requires_grad=False)

    @classmethod
    def from_config(cls, named_params: Sequence[tuple[str, Parameter]], cfg: OptimizerConfig,
                    lr: float) -> "AdamW":
        return cls(named_params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def step(self, grads: Sequence[Tensor], lr: Optional[float] = None, grad_scale: float = 1.0) -> None:
        """One update with ``grads`` (same order as the parameters) multiplied by
        ``grad_scale`` (the clipping coefficient, in (0, 1]: torch's ``clip_grad_norm_``
        then ``step``, in one pass); ``lr`` overrides self.lr."""
        if lr is not None:
            self.lr = float(lr)
        if not grad_scale > 0.0:
            raise ValueError(f"grad_scale must be positive, got {grad_scale}")
        self.step_count += 1
        bc1 = 1.0 - self.beta1 ** self.step_count
        bc2 = 1.0 - self.beta2 ** self.step_count
        root_bc2 = math.sqrt(bc2)
        lr_t, eps_t, wd_t, norm, lr_raw = (Tensor(x, ms.float32) for x in (
            self.lr * root_bc2 / bc1, self.eps * root_bc2, self.weight_decay * bc1 / root_bc2, 1.0 / grad_scale,
            self.lr))
        powers = (Tensor(self.beta1 ** self.step_count, ms.float32), Tensor(self.beta2 ** self.step_count, ms.float32))
        beta1, beta2 = self._betas
        host = bool(self._groups) and synchronous_dispatch() and str(ms.get_context("device_target")).upper() == "CPU"
        for g in self._groups:
            if not g.aliased():
                g.adopt()
            group_grads = [grads[i] for i in g.idx]
            if host and g.host_ready(group_grads):
                # the CPU route: the scaled gradient copied once, the decay a numpy pass over
                # the weights, then the Adam step (ops.Adam: 3.6 ms for 6.0M values against
                # 22 ms for the fused AdamW kernel, which runs one thread; issue 33)
                flat_grad = g.host_gradient(group_grads, grad_scale)
                if g.decay and self.weight_decay:
                    g.decay_in_place(1.0 - self.lr * self.weight_decay)
                self._adam(g.flat, g.exp_avg, g.exp_avg_sq, powers[0], powers[1], lr_raw, beta1, beta2, eps_t,
                           flat_grad)
                continue
            flat_grad = g.flat_gradient(group_grads)
            self._kernel(g.flat, g.exp_avg, g.exp_avg_sq, lr_t, beta1, beta2, eps_t,
                         wd_t if g.decay else self._no_decay, flat_grad, norm)
        for i in self._loose:
            p, m, v, g = self.params[i], self.exp_avg[i], self.exp_avg_sq[i], grads[i]
            if p.size == 0:  # an FSDP shard past the last row: nothing to update (the kernel refuses it)
                continue
            if p.untyped_storage().nbytes() != p.nbytes:  # a view (of another optimizer's buffer):
                p.set_data(Tensor(p.asnumpy().copy()))  # the kernel would leave it unchanged
            if g.dtype != p.dtype:
                g = g.astype(p.dtype)
            self._kernel(p, m, v, lr_t, beta1, beta2, eps_t, wd_t if self.decay[i] else self._no_decay, g, norm)

    def moment_sets(self) -> list[tuple[str, list[int], list[Parameter]]]:
        """(checkpoint prefix, parameter indices, state tensors aligned with them): what a
        checkpoint saves and resumes per parameter (MindFormers: ``adam_m`` / ``adam_v``)."""
        every = list(range(len(self.params)))
        return [("exp_avg", every, self.exp_avg), ("exp_avg_sq", every, self.exp_avg_sq)]

    def state_bytes(self) -> int:
        """Bytes of the moments this optimizer holds (this rank's shards)."""
        return int(sum(t.size * t.itemsize for t in self.exp_avg + self.exp_avg_sq))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Moments keyed ``exp_avg.<param>`` / ``exp_avg_sq.<param>`` plus ``step``."""
        out: dict[str, np.ndarray] = {"step": np.array(self.step_count, np.int64)}
        for name, m, v in zip(self.names, self.exp_avg, self.exp_avg_sq):
            # asnumpy() may share memory with the Parameter, which the kernel updates in place
            out[f"exp_avg.{name}"] = m.asnumpy().copy()
            out[f"exp_avg_sq.{name}"] = v.asnumpy().copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        missing = [k for n in self.names for k in (f"exp_avg.{n}", f"exp_avg_sq.{n}") if k not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {missing[0]} (and {len(missing) - 1} more)")
        self.step_count = int(np.asarray(state["step"]).reshape(-1)[0])
        for g in self._groups:
            g.load_moments([state[f"exp_avg.{self.names[i]}"] for i in g.idx],
                           [state[f"exp_avg_sq.{self.names[i]}"] for i in g.idx])
        for i in self._loose:
            name, m, v = self.names[i], self.exp_avg[i], self.exp_avg_sq[i]
            m.set_data(Tensor(np.ascontiguousarray(state[f"exp_avg.{name}"], np.float32)))
            v.set_data(Tensor(np.ascontiguousarray(state[f"exp_avg_sq.{name}"], np.float32)))


BUCKET_ELEMENTS = 1 << 24
"""Values per flat buffer at most (64 MB in float32; a larger parameter is a buffer of its
own): the step's concatenated gradient is one buffer's, a bounded transient."""


def _buckets(idx: list[int], sizes: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    filled = BUCKET_ELEMENTS
    for i, n in zip(idx, sizes):
        if filled + n > BUCKET_ELEMENTS:
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += n
    return out


def _has_storage(p: Parameter) -> bool:
    """False for a parameter built without memory (``meta``) that a layout fills later."""
    return getattr(p, "device", "") != "meta"
