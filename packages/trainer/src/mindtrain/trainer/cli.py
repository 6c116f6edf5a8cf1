"""``run_mindformer.py`` / ``mindtrain-train``: parse the command line, start, train.

    python run_mindformer.py --config CONFIG.yaml --mode 1 [--override section.field=value ...]
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \\
          --log_dir=./msrun_log run_mindformer.py --config CONFIG.yaml --mode 1

Takes every flag of MindFormers' ``run_mindformer.py`` under the same name and type. In
eager mode these act: ``--seed``, ``--output_dir``, ``--load_checkpoint``,
``--resume_training``, ``--register_path``, ``--options``, ``--train_dataset_dir``,
``--device_target`` (and ``--section.field value`` pairs, as config overrides); the others
are named once at start-up as having no effect. Every user mistake ends with one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Optional, Sequence

from mindtrain.config import (UserError, num_accumulation_steps, parse_config, resolve_parallelism, startup_notes,
                              validate_device)
from mindtrain.config.loader import apply_overrides, read_yaml

PROG = "run_mindformer.py"
USAGE = f"{PROG} --config CONFIG.yaml --mode 1 [--override section.field=value ...]"


class UsageError(UserError):
    """A command-line mistake."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (usage: {USAGE})")


def bool_flag(text: str) -> bool:
    """MindFormers' ``str2bool``: True / False in any letter case."""
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return value


def bool_or_name_flag(text: str):
    """MindFormers' ``str2bool_or_str``: True / False, else the text itself."""
    return {"true": True, "false": False}.get(text.lower(), text)


# MindFormers' flags that eager training has no use for: (name, type, nargs).
NO_EFFECT_FLAGS = (
    ("device_id", int, None), ("run_mode", str, None), ("do_eval", bool_flag, None),
    ("eval_dataset_dir", str, None), ("predict_data", str, "+"), ("modal_type", str, "+"),
    ("predict_batch_size", int, None), ("adapter_id", str, "+"), ("src_strategy_path_or_dir", str, None),
    ("auto_trans_ckpt", bool_flag, None), ("transform_process_num", int, None),
    ("only_save_strategy", bool_flag, None), ("strategy_load_checkpoint", str, None),
    ("remote_save_url", str, None), ("use_parallel", bool_flag, None), ("profile", bool_flag, None),
    ("epochs", int, None), ("batch_size", int, None), ("gradient_accumulation_steps", int, None),
    ("sink_mode", bool_flag, None), ("num_samples", int, None), ("do_sample", bool_flag, None),
    ("trust_remote_code", bool_flag, None),
)
_RUN_MODES = ("train", "finetune", "eval", "predict", "predict_with_train_model")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Eager-mode (PyNative) pretraining with mindtrain; takes the flags of "
                                       "MindFormers' run_mindformer.py.")
    p.add_argument("--config", help="YAML config file; a relative path is looked up beside run_mindformer.py, "
                                    "then in the current directory")
    p.add_argument("--mode", type=int, help="1 = eager (PyNative), the only supported mode; required")
    p.add_argument("--device_target", type=str, help="Ascend or CPU (sets context.device_target)")
    p.add_argument("--seed", type=int, help="sets training.seed")
    p.add_argument("--load_checkpoint", type=str, help="sets checkpoint.load_path")
    p.add_argument("--resume_training", type=bool_or_name_flag,
                   help="True: resume everything (checkpoint.no_load_optim=false); False: weights only")
    p.add_argument("--output_dir", type=str, help="folder for outputs the config leaves unset: "
                                                  "checkpoint/, metrics/, profile/")
    p.add_argument("--register_path", type=str, help="folder of Python modules imported at start-up "
                                                     "(their @register classes become usable by name)")
    p.add_argument("--train_dataset_dir", type=str, help="MindRecord file or folder for a MindDataset loader "
                                                         "(sets train_dataset.dataloader.dataset_files)")
    p.add_argument("--options", nargs="+", metavar="SECTION.FIELD=VALUE",
                   help="MindFormers' config overrides: KEY=VALUE, lists as 1,2,3 or [1,2,3]")
    p.add_argument("--override", "-o", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="replace one config value (value parsed as YAML); repeatable, "
                        "e.g. --override training.steps=20 --override checkpoint.enable_save=true")
    for name, kind, nargs in NO_EFFECT_FLAGS:
        p.add_argument(f"--{name}", type=kind, nargs=nargs, help="accepted for MindFormers; no effect in eager mode")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags; ``--section.field value`` pairs that are not flags become ``args.pairs``
    (config overrides, as MindFormers' run_mindformer.py reads them)."""
    args, rest = build_parser().parse_known_args(argv)
    args.pairs = _pairs(rest)
    if args.config is None:
        raise UsageError("--config is required: pass the YAML file, e.g. --config configs/pynative_ds3_tiny.yaml")
    if args.mode is None:
        raise UsageError("--mode is required: pass --mode 1 (eager/PyNative training)")
    if args.mode != 1:
        raise UsageError(f"--mode {args.mode} is not supported: only eager mode is (pass --mode 1); "
                         "static graph mode (--mode 0) is not available")
    if args.run_mode is not None and args.run_mode not in _RUN_MODES:
        raise UsageError(f"--run_mode must be one of {', '.join(_RUN_MODES)}, got {args.run_mode!r}")
    if isinstance(args.resume_training, str):
        raise UsageError(f"--resume_training {args.resume_training!r}: with a checkpoint section only True or False "
                         "is accepted (as in MindFormers); point --load_checkpoint at the checkpoint folder instead")
    return args


def _pairs(rest: list[str]) -> list[str]:
    tokens = [t for item in rest for t in (item.split("=", 1) if item.startswith("--") else [item])]
    if len(tokens) % 2 or any(not k.startswith("--") or len(k) < 3 for k in tokens[::2]):
        raise UsageError(f"unrecognized arguments: {' '.join(rest)} (a config value is set with "
                         "--section.field value, --options section.field=value or --override section.field=value)")
    return [f"{k[2:]}={v}" for k, v in zip(tokens[::2], tokens[1::2])]


def option_value(text: str) -> Any:
    """A ``--options`` value as MindFormers' ``ActionDict`` reads it: int, float, True/False,
    comma lists (``1,2`` or ``[1,2]``, nested brackets allowed), else the text."""
    text = text.strip().strip("'\"").strip()
    if text[:1] in "[(" and text[-1:] in "])":
        inner = text[1:-1].strip()
        return [option_value(v) for v in _split_top(inner)] if inner else []
    if "," in text:
        return [option_value(v) for v in _split_top(text)]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"TRUE": True, "FALSE": False}.get(text.upper(), text)


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise UsageError(f"--options: brackets do not pair up in {text!r}")
    return parts + [text[start:]]


def option_overrides(options: Optional[Sequence[str]]) -> list[str]:
    """``--options KEY=VALUE ...`` as ``--override`` strings (JSON is YAML)."""
    out = []
    for item in options or ():
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--options {item!r} must look like section.field=value")
        out.append(f"{key.strip()}={json.dumps(option_value(text))}")
    return out


def resolve_path(path: str, base_dir: Optional[str]) -> str:
    """A relative path as MindFormers resolves it (beside run_mindformer.py), falling back to
    the current directory; the path as given when neither exists."""
    if os.path.isabs(path) or not base_dir:
        return path
    beside = os.path.join(base_dir, path)
    return beside if os.path.exists(beside) else path


def _get(raw: dict, dotted: str) -> Any:
    node: Any = raw
    for key in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def flag_overrides(args: argparse.Namespace, raw: dict) -> list[str]:
    """The acting flags as config overrides (before --options and --override, as in
    MindFormers, where --options is merged after the flags)."""
    out = []
    if args.device_target is not None:
        out.append(f"context.device_target={json.dumps(args.device_target)}")
    if args.seed is not None:
        out.append(f"training.seed={args.seed}")
    if args.load_checkpoint is not None:
        out.append(f"checkpoint.load_path={json.dumps(args.load_checkpoint)}")
    if args.resume_training is not None:
        # MindFormers maps resume_training onto checkpoint.no_load_optim (opposite meaning)
        if _get(raw, "checkpoint.load_optimizer") is not None:
            out.append(f"checkpoint.load_optimizer={json.dumps(args.resume_training)}")
        else:
            out.append(f"checkpoint.no_load_optim={json.dumps(not args.resume_training)}")
    return out


def output_dir_overrides(output_dir: str, raw: dict) -> list[str]:
    """MindFormers' output folder: the root of every output whose path the config leaves
    unset (it puts checkpoints in <output_dir>/checkpoint, profiles in <output_dir>/profile)."""
    out = []
    for dotted, leaf in (("checkpoint.save_path", "checkpoint"), ("monitor.metrics_dir", "metrics"),
                         ("profiler.output_path", "profile")):
        if not _get(raw, dotted):
            out.append(f"{dotted}={json.dumps(os.path.join(output_dir, leaf))}")
    return out


def dataset_dir_overrides(dataset_dir: str, raw: dict) -> list[str]:
    """MindFormers hands --train_dataset_dir to a MindRecord loader (a file or a folder
    searched for .mindrecord files); the Megatron loader reads data_path instead."""
    kind = _get(raw, "train_dataset.dataloader.type")
    if kind != "MindDataset":
        raise UsageError(f"--train_dataset_dir applies to train_dataset.dataloader.type MindDataset (MindRecord "
                         f"files), but the loader is {kind or 'BlendedMegatronDatasetDataLoader'}; set "
                         "train_dataset.dataloader.config.data_path instead")
    return [f"train_dataset.dataloader.dataset_files={json.dumps(dataset_dir)}"]


def load_with_flags(args: argparse.Namespace, base_dir: Optional[str] = None):
    """Read the config and apply, in order: the acting flags, --options, --override, the
    --section.field value pairs, then --train_dataset_dir and --output_dir defaults."""
    raw = read_yaml(resolve_path(args.config, base_dir))
    raw = apply_overrides(raw, flag_overrides(args, raw))
    raw = apply_overrides(raw, option_overrides(args.options) + list(args.override) + list(args.pairs))
    if args.train_dataset_dir is not None:
        raw = apply_overrides(raw, dataset_dir_overrides(args.train_dataset_dir, raw))
    if args.output_dir is not None:
        raw = apply_overrides(raw, output_dir_overrides(os.path.expanduser(args.output_dir), raw))
    if args.resume_training is not None and not _get(raw, "checkpoint.load_path"):
        raise UsageError(f"--resume_training {args.resume_training}: there is no checkpoint to load; pass "
                         "--load_checkpoint FOLDER or set checkpoint.load_path")
    return parse_config(raw)


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The no-effect flags the user passed, as written (``--use_parallel True``)."""
    out = []
    for name, _kind, _nargs in NO_EFFECT_FLAGS:
        value = getattr(args, name)
        if value is not None:
            shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
            out.append(f"--{name} {shown}")
    return out


def _fail(message: str, status: int, distributed: bool) -> int:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if distributed:
        # Peers may be waiting in a collective; interpreter shutdown could block in the
        # communication library, so leave now and let msrun stop the others.
        os._exit(status)
    return status


def main(argv: Optional[Sequence[str]] = None, base_dir: Optional[str] = None) -> int:
    """``base_dir``: the folder relative --config and --register_path are looked up in
    first (run_mindformer.py's, as MindFormers does); then the current directory."""
    sys.stdout.reconfigure(line_buffering=True)
    distributed = False
    rank = 0
    try:
        args = parse_args(argv)
        if args.register_path is not None:
            from mindtrain.trainer.registry import load_register_path

            load_register_path(resolve_path(args.register_path, base_dir))
        cfg = load_with_flags(args, base_dir)  # config errors surface before the slow start-up
        from mindtrain.trainer import runtime

        rt, note = runtime.start(cfg.context.device_target)
        distributed, rank = rt.distributed, rt.rank
        validate_device(cfg, rt.device)  # the device-dependent rules, for a device chosen by default
        dims = resolve_parallelism(cfg.parallelism, rt.world_size)
        num_accumulation_steps(cfg, dims)
        if rank == 0:
            print(f"mindtrain: {note}")
            for line in startup_notes(cfg, rt.device):  # fields with no effect here, said once
                print(f"mindtrain: {line}")
            ignored = ignored_flags(args)
            if ignored:
                print(f"mindtrain: no effect in eager mode (--mode 1), ignored: {', '.join(ignored)}")
        from mindtrain.trainer.trainer import Trainer

        Trainer(cfg, rt).train()
    except UserError as err:
        where = f" (rank {rank})" if distributed else ""
        return _fail(f"{PROG}: error{where}: {err}", 2, distributed)
    except KeyboardInterrupt:
        return _fail(f"{PROG}: interrupted", 130, distributed)
    except Exception as err:  # a bug or a broken environment: keep the traceback, name the rank
        traceback.print_exc()
        return _fail(f"{PROG}: rank {rank} failed: {type(err).__name__}: {err}", 1, distributed)
    sys.stdout.flush()
    return 0  # a normal exit: msrun's scheduler expects each worker to finalize with it


if __name__ == "__main__":
    sys.exit(main())
