"""One communication group as seen from one rank (pure Python).

Its own module so that :mod:`mindtrain.parallel.collectives` (which takes groups) and
:mod:`mindtrain.parallel.mesh` (which makes them, and creates their backend groups through
collectives) import it without importing each other both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Group:
    """One communication group as seen from one rank.

    ``ranks`` are global ranks in group order; ``index`` is this rank's position in it.
    ``name`` is the backend group name (``None`` until created, and always for size 1).
    """

    dim: str
    ranks: tuple[int, ...]
    index: int
    name: Optional[str] = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """Global rank of group member ``index``."""
        return self.ranks[index]
