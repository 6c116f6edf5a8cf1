"""On-disk cache of index arrays: keyed by a hash, written atomically, built by one process.

The first process to take the lock file builds and writes the arrays; every other process
(other ranks on the node, later runs) blocks on the lock and then memory-maps the result.
The description file is written last and marks a complete entry.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from typing import Callable, Optional

import numpy as np

try:
    import fcntl
except ImportError:  # not on POSIX: concurrent builders are still safe, just not deduplicated
    fcntl = None


def description_hash(description: str) -> str:
    return hashlib.md5(description.encode("utf-8")).hexdigest()


def _atomic_write(path: str, write: Callable) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _paths(cache_dir: str, base: str, names):
    return (os.path.join(cache_dir, f"{base}-description.txt"),
            {n: os.path.join(cache_dir, f"{base}-{n}.npy") for n in names})


def _complete(desc_path: str, paths: dict) -> bool:
    return os.path.isfile(desc_path) and all(os.path.isfile(p) for p in paths.values())


def _load(paths: dict) -> dict:
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}


def cached_build(cache_dir: Optional[str], description: str, kind: str, names: list,
                 build: Callable[[], dict]) -> tuple[dict, bool]:
    """Arrays ``names`` from the cache under ``cache_dir``, building them on a miss.

    Returns (arrays, built_here). With ``cache_dir`` None the arrays are built in memory.
    """
    if cache_dir is None:
        return build(), True
    base = f"{description_hash(description)}-{kind}"
    desc_path, paths = _paths(cache_dir, base, names)
    if _complete(desc_path, paths):
        return _load(paths), False
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(os.path.join(cache_dir, f"{base}.lock"), "a+b")
    except OSError as err:
        warnings.warn(f"index cache {cache_dir} is not writable ({err.strerror}); building the "
                      "indices in memory. Set path_to_cache to a writable folder to reuse them.")
        return build(), True
    with lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            except OSError:
                pass  # a filesystem without locks: atomic writes keep concurrent builds correct
        if _complete(desc_path, paths):
            return _load(paths), False
        arrays = build()
        for n, p in paths.items():
            _atomic_write(p, lambda f, a=arrays[n]: np.save(f, a, allow_pickle=False))
        _atomic_write(desc_path, lambda f: f.write(description.encode("utf-8")))
    return arrays, True
