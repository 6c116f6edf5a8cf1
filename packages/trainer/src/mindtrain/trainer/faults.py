"""Test-only fault switches, read from ``MINDTRAIN_FAULT`` (never set in a real run):

- ``hang:RANK:STEP``: rank RANK sleeps for good before step STEP (the hang watch's test);
- ``slow_save:SECONDS``: every rank sleeps SECONDS after writing a checkpoint's files and
  before the folder is renamed into place (a window for a signal "during the save");
- ``save_error:STEP``: writing step STEP's checkpoint fails as on a full disk (ENOSPC).
"""

from __future__ import annotations

import errno
import os
import time
from typing import Optional


def _spec() -> list[str]:
    return os.environ.get("MINDTRAIN_FAULT", "").split(":")


def hang_step(rank: int) -> Optional[int]:
    """The step before which ``rank`` hangs, if the switch names it."""
    parts = _spec()
    if len(parts) == 3 and parts[0] == "hang" and parts[1] == str(rank) and parts[2].isdigit():
        return int(parts[2])
    return None


def hang() -> None:
    time.sleep(10 ** 6)


def slow_save() -> None:
    parts = _spec()
    if len(parts) == 2 and parts[0] == "slow_save":
        time.sleep(float(parts[1]))


def save_error(step: int) -> None:
    parts = _spec()
    if len(parts) == 2 and parts[0] == "save_error" and parts[1] == str(step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "MINDTRAIN_FAULT")
