"""Trainer callbacks: the ``callbacks`` config list, resolved from the registry.

The protocol is MindFormers' PyNative ``TrainerCallback``
(mindformers/pynative/callback/callback.py): every hook takes ``(args, state, **kwargs)``
where ``args`` is the config and ``state`` the :class:`TrainerState`, so a MindFormers
callback class ports by changing its decorator to ``@register("callback", "Name")``.
``on_step_end`` also gets ``loss``, ``grad_norm``, ``lr``, ``skipped``, ``record`` (the
step's metrics dict), ``model`` and ``optimizer``.

A config entry ``{type: Name, key: value, ...}`` builds ``Name(key=value, ...)``; the class
comes from the registry only (built-ins below, or modules under ``--register_path``),
never from an import path in the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from mindtrain.config import ConfigError
from mindtrain.trainer.registry import RegistryError, lookup, register

KIND = "callback"
EVENTS = ("on_begin", "on_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_step_begin", "on_step_end")


@dataclass
class TrainerState:
    """Where training is, as MindFormers' TrainerState names it."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    epoch_step: int = 0
    global_batch_size: int = 0
    num_accumulation_steps: int = 1
    consumed_samples: int = 0
    loss_scale: float = 1.0
    is_train_begin: bool = False
    is_train_end: bool = False

    def save_to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TrainerCallback:
    """Base class: override the events you need; each gets ``(args, state, **kwargs)``."""

    def on_begin(self, args, state: TrainerState, **kwargs): ...

    def on_end(self, args, state: TrainerState, **kwargs): ...

    def on_train_begin(self, args, state: TrainerState, **kwargs): ...

    def on_train_end(self, args, state: TrainerState, **kwargs): ...

    def on_epoch_begin(self, args, state: TrainerState, **kwargs): ...

    def on_epoch_end(self, args, state: TrainerState, **kwargs): ...

    def on_step_begin(self, args, state: TrainerState, **kwargs): ...

    def on_step_end(self, args, state: TrainerState, **kwargs): ...


@register(KIND, "MaxLogitsMonitor")
class MaxLogitsMonitor(TrainerCallback):
    """MindFormers' per-layer max-attention-logit dump (``MaxLogitsMonitor``): every
    ``step_interval`` steps, one line per layer with its heads' max pre-softmax logits of the
    step (all ranks'), then their mean and max, in MindFormers' format
    (``step:[    3/   10] max_attention_logit/<layer>: [...]``). Naming it makes the model
    track the logits (as MindFormers' ``configure_max_logits_tracking`` does)."""

    def __init__(self, step_interval: int = 1):
        if isinstance(step_interval, bool) or not isinstance(step_interval, int) or step_interval <= 0:
            raise ConfigError("callbacks", f"MaxLogitsMonitor step_interval must be a positive int, "
                              f"got {step_interval!r}")
        self.step_interval = step_interval

    def lines(self, state: TrainerState, table) -> list[str]:
        """The lines of one step's ``table`` (``{layer: [heads]}``)."""
        head = f"step:[{state.global_step:5d}/{state.max_steps:5d}] max_attention_logit/"
        out, values = [], []
        for i in sorted(table):
            v = [float(x) for x in table[i]]
            values += v
            out.append(f"{head}model.layers.{i}.self_attn.core_attention.max_logits_val: "
                       f"[{', '.join(f'{x:.4g}' for x in v)}]")
        if values:
            out.append(f"{head}mean: {sum(values) / len(values):.4g}")
            out.append(f"{head}max: {max(values):.4g}")
        return out

    def on_step_end(self, args, state: TrainerState, **kwargs):
        if state.global_step % self.step_interval:
            return
        table = getattr(kwargs.get("model"), "max_attention_logits", None)
        for line in self.lines(state, table or {}):
            print(line, flush=True)


@register(KIND, "MaxLogitsReset")
class MaxLogitsReset(MaxLogitsMonitor):
    """MindFormers' deprecated name: :class:`MaxLogitsMonitor` every step."""

    def __init__(self):
        super().__init__(step_interval=1)


def build_callbacks(entries: Sequence) -> list:
    """Instances of the configured callbacks (CallbackConfig: ``type`` + ``params``)."""
    out = []
    for i, entry in enumerate(entries):
        where = f"callbacks[{i}]"
        if not entry.type:
            raise ConfigError(f"{where}.type", "is missing; name a registered callback class")
        try:
            cls = lookup(KIND, entry.type)
        except RegistryError as err:
            raise ConfigError(f"{where}.type", str(err)) from None
        try:
            cb = cls(**dict(entry.params))
        except TypeError as err:
            raise ConfigError(where, f"{entry.type}({', '.join(entry.params)}): {err}") from None
        missing = [e for e in EVENTS if not callable(getattr(cb, e, None))]
        if len(missing) == len(EVENTS):
            raise ConfigError(f"{where}.type", f"{entry.type} has none of the callback events ({', '.join(EVENTS)})")
        out.append(cb)
    return out


class CallbackHandler:
    """Calls one event on every callback, in list order; a callback may define only some."""

    def __init__(self, callbacks: Sequence, **objects):
        self.callbacks = list(callbacks)
        self.objects = objects  # model, optimizer, ...: passed to every event

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, event: str, args, state: TrainerState, **kwargs) -> None:
        for cb in self.callbacks:
            fn: Optional[Any] = getattr(cb, event, None)
            if callable(fn):
                fn(args, state, **self.objects, **kwargs)
