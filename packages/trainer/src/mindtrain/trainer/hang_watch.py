"""The hang watch: a rank that goes ``monitor.hang_timeout`` seconds without finishing a step
ends the job, naming the rank that fell behind and the step.

Every rank records, in a small file per rank in a folder its msrun job's local ranks share,
the step it began last. From the end of the first step (which also compiles; torchtitan
likewise gives its first step a longer timeout), a watch thread per rank (it runs while the main thread waits in a
collective: MindSpore releases the interpreter there) fires when its own rank has not finished
a step for the timeout: it reads the other ranks' files, names the rank with the oldest step
(the one that has not reached the step its peers wait in), prints one line, leaves the line
for msrun's scheduler (which reports it instead of "stopped responding"), and ends its process;
msrun then stops the other workers. Torchtitan and Megatron end a hung job through the
collective timeout of NCCL; MindSpore's CPU collectives have none, so this watch stands in.

``MINDTRAIN_FAULT=hang:RANK:STEP`` (tests only, :mod:`mindtrain.trainer.faults`) makes rank
RANK sleep before step STEP.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from mindtrain.trainer import faults

HANG_EXIT = 3
REPORT = "hang.txt"


def job_folder() -> str:
    """Shared by one msrun job's local processes (workers and scheduler): keyed by msrun's
    master port and the launcher process (its pid and start time, so a reused pid differs)."""
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    port = os.environ.get("MS_SCHED_PORT", "0")
    return os.path.join(tempfile.gettempdir(), f"mindtrain-job-{port}-{launcher}-{started}")


def scheduler_report() -> Optional[str]:
    """The hang line a worker left for this job, if any (read by msrun's scheduler process)."""
    try:
        with open(os.path.join(job_folder(), REPORT)) as f:
            return f.read().strip() or None
    except OSError:
        return None


class HangWatch:
    def __init__(self, rank: int, world_size: int, timeout: float, log: Callable[[str], None],
                 folder: Optional[str] = None):
        self.rank, self.world_size, self.timeout, self.log = rank, world_size, float(timeout), log
        self.folder = folder or job_folder()
        os.makedirs(self.folder, exist_ok=True)
        self._last = time.monotonic()
        self._armed = False  # from the first step's end: that step also compiles and warms up
        self._step = 0
        self._fault = faults.hang_step(rank)
        self._beat(0)
        self._stop = threading.Event()
        self._thread = None
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="mindtrain-hang-watch")
            self._thread.start()

    def close(self) -> None:
        """End the watch thread (training is over): nothing runs beside interpreter shutdown."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def step_begin(self, step: int) -> None:
        if self._fault is not None and step == self._fault:
            faults.hang()  # MINDTRAIN_FAULT: this rank hangs here (tests)
        self._step = step
        self._beat(step)

    def step_end(self) -> None:
        self._last = time.monotonic()
        self._armed = True

    def _beat(self, step: int) -> None:
        path = os.path.join(self.folder, f"rank_{self.rank:05d}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step, "time": time.time()}, f)
        os.replace(tmp, path)

    def _steps(self) -> dict[int, int]:
        out = {}
        for r in range(self.world_size):
            try:
                with open(os.path.join(self.folder, f"rank_{r:05d}.json")) as f:
                    out[r] = int(json.load(f)["step"])
            except (OSError, ValueError, KeyError):
                pass  # another node's rank, or not started
        return out

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 10)):
            if self._armed and time.monotonic() - self._last > self.timeout:
                self._fire()

    def _fire(self) -> None:
        steps = self._steps()
        behind = min(steps.values()) if steps else self._step
        late = sorted(r for r, s in steps.items() if s == behind)
        waiting = max(steps.values()) if steps else self._step
        t = int(self.timeout)
        if behind < waiting:
            who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
            line = (f"mindtrain: {who} hung: no step finished for {t} s (monitor.hang_timeout) and it never "
                    f"reached step {waiting}, which the other ranks wait in; ending the job")
        else:
            line = (f"mindtrain: the job hung in step {waiting}: no step finished for {t} s "
                    f"(monitor.hang_timeout) on rank {self.rank}, and every rank of this node began that step; "
                    "ending the job")
        self.log(line)
        print(line, file=sys.stderr, flush=True)
        try:  # the first rank to fire tells msrun's scheduler
            fd = os.open(os.path.join(self.folder, REPORT), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(line)
        except OSError:
            pass
        sys.stdout.flush()
        os._exit(HANG_EXIT)

