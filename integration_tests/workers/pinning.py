"""Pin a worker process to one core, before MindSpore starts its threads (they inherit the
mask): with more processes than cores, unpinned runtime threads of every process spread over
every core and burn CPU time switching. msrun rank r takes core r mod #cores; a plain
reference process (no RANK_ID) takes ``ref_core`` (default the last core). Import and call it
before numpy or mindspore."""

import os


def pin_to_one_core(ref_core: int = -1) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    rank = os.environ.get("RANK_ID")
    os.sched_setaffinity(0, {cpus[int(rank) % len(cpus)] if rank is not None else cpus[ref_core % len(cpus)]})
