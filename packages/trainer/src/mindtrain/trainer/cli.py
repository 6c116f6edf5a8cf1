"""``run_mindformer.py`` / ``mindtrain-train``: parse the command line, start, train.

    python run_mindformer.py --config CONFIG.yaml --mode 1 [--override section.field=value ...]
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \\
          --log_dir=./msrun_log run_mindformer.py --config CONFIG.yaml --mode 1

Every user mistake ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Optional, Sequence

from mindtrain.config import UserError, load_config, num_accumulation_steps, resolve_parallelism

PROG = "run_mindformer.py"


class UsageError(UserError):
    """A command-line mistake."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (usage: {PROG} --config CONFIG.yaml --mode 1 [--override section.field=value ...])")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Eager-mode (PyNative) pretraining with mindtrain.")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--mode", type=int, help="1 = eager (PyNative), the only supported mode; required")
    p.add_argument("--override", "-o", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="replace one config value (value parsed as YAML); repeatable, "
                        "e.g. --override training.steps=20 --override checkpoint.enable_save=true")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.config is None:
        raise UsageError("--config is required: pass the YAML file, e.g. --config configs/pynative_ds3_tiny.yaml")
    if args.mode is None:
        raise UsageError("--mode is required: pass --mode 1 (eager/PyNative training)")
    if args.mode != 1:
        raise UsageError(f"--mode {args.mode} is not supported: only eager mode is (pass --mode 1); "
                         "static graph mode (--mode 0) is not available")
    return args


def _fail(message: str, status: int, distributed: bool) -> int:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if distributed:
        # Peers may be waiting in a collective; interpreter shutdown could block in the
        # communication library, so leave now and let msrun stop the others.
        os._exit(status)
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)
    distributed = False
    rank = 0
    try:
        args = parse_args(argv)
        cfg = load_config(args.config, args.override)  # config errors surface before the slow start-up
        from mindtrain.trainer import runtime

        rt, note = runtime.start(cfg.context.device_target)
        distributed, rank = rt.distributed, rt.rank
        dims = resolve_parallelism(cfg.parallelism, rt.world_size)
        num_accumulation_steps(cfg, dims)
        if rank == 0:
            print(f"mindtrain: {note}")
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
