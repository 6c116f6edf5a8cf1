"""YAML -> dataclasses with typed conversion, dotted overrides, and the way back."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Iterable, Optional, Union

import yaml

from mindtrain.config.errors import ConfigError
from mindtrain.config.legacy import check_not_legacy
from mindtrain.config.model_names import to_canonical
from mindtrain.config import schema as S
from mindtrain.config.schema import MindTrainConfig

_MISSING = object()


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
        return f"a list of {plural.get(inner, 'values')}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(value, options[0], path)
        for arg in options:  # the first member that takes the value as it is
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(path, f"must be {_type_name(tp)}, got {value!r}")
    if value is None:
        raise ConfigError(path, f"must be {_type_name(tp)}, got null")
    if dataclasses.is_dataclass(tp):
        value = _special_forms(tp, value, path)
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping of fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(path, f"must be {_type_name(tp)}, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(path, f"must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads "1e-5" (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, f"must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(path, f"must be a string, got {value!r}")
    raise AssertionError(f"unsupported schema type {tp!r} at {path}")


def _suggest(key: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _same(v):
    return v


def _negate(v):
    return not v if isinstance(v, bool) else v


# mindtrain's earlier field names -> (MindFormers name, value conversion). One schema: the
# old name is read into the new field; giving both is an error.
ALIASES: dict[type, dict[str, tuple[str, Any]]] = {
    S.CheckpointConfig: {"keep_last": ("save_max", _same), "save_interval": ("save_interleaved_steps", _same),
                         "load_optimizer": ("no_load_optim", _negate)},
    S.ParallelismConfig: {"data_parallel_sharding_strategy": ("data_parallel_shard_strategy", _same),
                          "pipeline_schedule": ("pipeline_parallel_schedule", _same),
                          "pipeline_layers_per_stage": ("pipeline_parallel_layers_per_stage", _same)},
    S.TensorboardConfig: {"tensorboard_dir": ("output_dir", _same)},
}


def _resolve_aliases(cls: type, data: dict, path: str) -> dict:
    table = ALIASES.get(cls)
    if not table:
        return data
    out = dict(data)
    for old, (new, conv) in table.items():
        if old in out:
            where = f"{path}.{old}" if path else old
            if new in out:
                raise ConfigError(where, f"is another name for '{new}', which is also set; keep one of them")
            out[new] = conv(out.pop(old))
    return out


def _special_forms(cls: type, data: Any, path: str) -> Any:
    """Shorthands MindFormers configs use: ``train_state: true`` and callback entries whose
    keys besides ``type`` are the callback's arguments."""
    if cls is S.TrainStateConfig and isinstance(data, bool):
        return {f.name: data for f in dataclasses.fields(cls)}
    if cls is S.CallbackConfig and isinstance(data, dict) and "type" not in data:
        raise ConfigError(f"{path}.type", "is required: the registered callback class name ({type: Name, ...})")
    if cls is S.CallbackConfig and isinstance(data, dict) and "params" not in data:
        rest = {k: v for k, v in data.items() if k != "type"}
        return {"type": data.get("type"), "params": rest} if "type" in data else data
    return data


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from a parsed-YAML mapping; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    data = _resolve_aliases(cls, data, path)
    if cls is S.ModelConfig:
        data = to_canonical(data, path or "model")
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(where, "unknown key" + _suggest(str(key), names)
                              + f"; allowed keys: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{path}.{name}" if path else name)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for YAML output or logging)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Any, path: Optional[str] = None) -> str:
    """YAML text of ``cfg``; also written to ``path`` when given."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return text


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a raw mapping in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError("", f"override '{item}' must look like section.field=value")
        dotted, _, text = item.partition("=")
        keys = dotted.strip().split(".")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(dotted, f"override value {text!r} is not valid YAML: {err}") from None
        node = raw
        for i, key in enumerate(keys[:-1]):
            nxt = node.get(key)
            if nxt is None:
                nxt = node[key] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(keys[: i + 1]), "is not a section; cannot override inside it")
            node = nxt
        node[keys[-1]] = value
    return raw


def read_yaml(path: str) -> dict:
    """Parse a YAML file safely (no Python object tags) into a mapping."""
    if not os.path.isfile(path):
        raise ConfigError("", f"config file '{path}' does not exist; pass an existing YAML file with --config")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError("", f"config file '{path}' is not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("", f"config file '{path}' cannot be read: {err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"config file '{path}' must hold a mapping of sections at the top level")
    return raw


# The dataset fields the quick start names are required in a config file; every other field
# of BlendedMegatronDatasetDataLoader's ``config`` defaults as MindFormers' loader defaults it
# (``MegatronDatasetBuilder.init_gpt_dataset_config``: ``self.config.get(name, default)``), so
# a MindFormers file that leaves them out means what it means there. The library's own
# GPTDatasetConfig keeps its defaults for programmatic use.
REQUIRED_DATASET_FIELDS = ("seq_length", "eod", "pad", "create_compressed_eod_mask", "data_path")
MINDFORMERS_DATASET_DEFAULTS = {"seed": 1234, "eod_mask_loss": False, "reset_position_ids": False,
                                "create_attention_mask": True, "reset_attention_mask": False}


def check_dataset_fields_given(raw: dict) -> None:
    """A one-line error naming the first required dataset ``config`` field missing from a
    config file; the others, when missing, take MindFormers' loader defaults (in ``raw``).
    ``split`` is required once data_path is set (the validator says so)."""
    loader = (raw.get("train_dataset") or {}).get("dataloader") if isinstance(raw.get("train_dataset"), dict) else None
    if not isinstance(loader, dict) or loader.get("type", "BlendedMegatronDatasetDataLoader") != \
            "BlendedMegatronDatasetDataLoader" or not isinstance(loader.get("config"), dict):
        return  # a missing config section, or another loader type, is the validator's to report
    given = loader["config"]
    defaults = S.GPTDatasetConfig()
    for name in REQUIRED_DATASET_FIELDS:
        if name not in given:
            example = "" if name == "data_path" else f" (e.g. {name}: {getattr(defaults, name)})"
            raise ConfigError(f"train_dataset.dataloader.config.{name}",
                              f"is required: the quick start's dataset fields must be given{example}")
    for name, value in MINDFORMERS_DATASET_DEFAULTS.items():
        given.setdefault(name, value)
    if "eod_pad_length" not in given:  # MindFormers reads the older name first
        given["eod_pad_length"] = given.pop("compressed_eod_mask_length", 128)
    else:
        given.pop("compressed_eod_mask_length", None)


def parse_config(raw: dict, overrides: Iterable[str] = (), validate: bool = True,
                 world_size: Optional[int] = None) -> MindTrainConfig:
    """Build and (by default) validate a config from a raw mapping."""
    raw = apply_overrides(raw, overrides)
    check_not_legacy(raw)
    check_dataset_fields_given(raw)
    cfg = from_dict(MindTrainConfig, raw)
    if validate:
        from mindtrain.config.validate import validate_config

        validate_config(cfg, world_size=world_size)
    return cfg


def load_config(path: str, overrides: Iterable[str] = (), validate: bool = True,
                world_size: Optional[int] = None) -> MindTrainConfig:
    """Load, override and validate a YAML config file.

    ``overrides`` are ``section.field=value`` strings. ``world_size``, when known, also
    checks that the parallel degrees fit it.
    """
    return parse_config(read_yaml(path), overrides, validate=validate, world_size=world_size)
