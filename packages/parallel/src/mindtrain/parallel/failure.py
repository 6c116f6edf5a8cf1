"""End the whole job when one rank raises, instead of leaving the others in a collective.

An uncaught exception on one rank would otherwise run interpreter shutdown (which can
block in the communication library's finalizer) while its peers wait in a collective.
The handler prints the error with the rank, then leaves with ``os._exit(1)``; msrun
(``--join=True``) sees the non-zero exit, kills the other workers and reports the job as
failed.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

_installed = {"rank": None}


def _report_and_exit(rank: int, exc_type, exc, tb) -> None:
    try:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"{text}mindtrain: rank {rank} failed: {exc_type.__name__}: {exc}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(1)


def install_failure_handler(rank: int) -> None:
    """Make an uncaught exception in any thread of this rank end the process at once."""
    _installed["rank"] = rank
    if getattr(sys.excepthook, "_mindtrain", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            os._exit(130)
        _report_and_exit(_installed["rank"], exc_type, exc, tb)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        _report_and_exit(_installed["rank"], args.exc_type, args.exc_value, args.exc_traceback)

    hook._mindtrain = True
    sys.excepthook = hook
    threading.excepthook = thread_hook
