"""User-facing errors of mindtrain-data (subclasses of mindtrain.config.UserError)."""

import sys
from typing import Callable

from mindtrain.config import ConfigError, UserError


class DataFileError(UserError):
    """A data file (.bin/.idx, json input, tokenizer) is missing, damaged or inconsistent."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


def exit_status(command: Callable[[], object]) -> int:
    """Run a command-line tool's work: 0, or its UserError as one ``error:`` line on stderr and 2."""
    try:
        command()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


__all__ = ["ConfigError", "DataFileError", "UserError", "exit_status"]
