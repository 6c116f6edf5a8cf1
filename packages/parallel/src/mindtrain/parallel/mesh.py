"""The device mesh: rank coordinates over [pp, dp_shard, cp, tp] and one group per dimension.

Pure Python until :meth:`DeviceMesh.init_process_groups` is called, so layouts can be
resolved and checked without MindSpore or msrun.

Layout (outermost first): ``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``. Expert
parallelism borrows ranks from the flattened dp_shard x cp index ``d = dp_i * cp + cp_i``:
``ep_i = d % ep`` (consecutive ranks form an EP group) and ``edp_i = d // ep`` (the
expert-data-parallel group over which expert weights are sharded by FSDP).
"""

from __future__ import annotations

from typing import Optional, Union

from mindtrain.config import ConfigError, ParallelDims, ParallelismConfig, resolve_parallelism
from mindtrain.parallel.group import Group

DIMS = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp", "dense", "dense_replica", "world")
"""Group names a mesh answers to. ``dp`` is the data-parallel-shard (FSDP) dimension;
``dense`` the consecutive dp ranks that shard the dense weights under HSDP
(``dense_shard`` of them; all of dp without HSDP) and ``dense_replica`` the dp ranks holding
the same dense shard."""

_ALIASES = {"dp_shard": "dp", "fsdp": "dp"}


class DeviceMesh:
    """Rank coordinates and groups for one rank of a resolved parallel layout."""

    def __init__(self, dims: ParallelDims, rank: int):
        if not 0 <= rank < dims.world_size:
            raise ConfigError("", f"rank {rank} is outside the world of {dims.world_size} workers")
        self.dims = dims
        self.world_size = dims.world_size
        self.global_rank = rank
        self._names: dict[str, Optional[str]] = {}
        self._created = False

    @classmethod
    def from_config(cls, parallelism: Union[ParallelismConfig, ParallelDims],
                    world_size: int, rank: int) -> "DeviceMesh":
        """Resolve ``parallelism`` (``-1`` takes what remains) for ``world_size`` workers."""
        if isinstance(parallelism, ParallelDims):
            dims = parallelism
            if dims.world_size != world_size:
                raise ConfigError("", f"the layout was resolved for {dims.world_size} workers, "
                                      f"but {world_size} are running")
        else:  # resolve_parallelism checks the degrees; ParallelDims checks itself when made
            dims = resolve_parallelism(parallelism, world_size)
        return cls(dims, rank)

    # ---- coordinates ----------------------------------------------------------------
    def coords(self, rank: Optional[int] = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this rank) on every dimension."""
        r = self.global_rank if rank is None else rank
        d = self.dims
        tp_i = r % d.tp
        cp_i = (r // d.tp) % d.cp
        dp_i = (r // (d.tp * d.cp)) % d.dp_shard
        pp_i = r // (d.tp * d.cp * d.dp_shard)
        dc = dp_i * d.cp + cp_i
        s = d.dense_shard_size
        return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i, "dp_cp": dc,
                "ep": dc % d.ep, "edp": dc // d.ep, "dense": dp_i % s, "dense_replica": dp_i // s, "world": r}

    def rank(self, dim: str) -> int:
        """This rank's index within its ``dim`` group."""
        return self.coords()[_dim(dim)]

    def size(self, dim: str) -> int:
        """Number of ranks in a ``dim`` group."""
        d = self.dims
        return {"pp": d.pp, "dp": d.dp_shard, "cp": d.cp, "tp": d.tp, "dp_cp": d.dp_shard * d.cp,
                "ep": d.ep, "edp": d.dp_shard * d.cp // d.ep, "dense": d.dense_shard_size,
                "dense_replica": d.dp_shard // d.dense_shard_size, "world": d.world_size}[_dim(dim)]

    def group_ranks(self, dim: str, rank: Optional[int] = None) -> tuple[int, ...]:
        """Global ranks of the ``dim`` group that contains ``rank`` (default: this rank)."""
        dim = _dim(dim)
        c = self.coords(rank)
        d = self.dims

        def at(pp_i: int, dc: int, tp_i: int) -> int:
            return (pp_i * d.dp_shard * d.cp + dc) * d.tp + tp_i

        dc = c["dp_cp"]
        if dim == "world":
            return tuple(range(d.world_size))
        if dim == "pp":
            return tuple(at(i, dc, c["tp"]) for i in range(d.pp))
        if dim == "tp":
            return tuple(at(c["pp"], dc, i) for i in range(d.tp))
        if dim == "dp":
            return tuple(at(c["pp"], i * d.cp + c["cp"], c["tp"]) for i in range(d.dp_shard))
        if dim in ("dense", "dense_replica"):
            s = d.dense_shard_size
            dps = ([c["dense_replica"] * s + j for j in range(s)] if dim == "dense"
                   else [k * s + c["dense"] for k in range(d.dp_shard // s)])
            return tuple(at(c["pp"], i * d.cp + c["cp"], c["tp"]) for i in dps)
        if dim == "cp":
            return tuple(at(c["pp"], c["dp"] * d.cp + i, c["tp"]) for i in range(d.cp))
        if dim == "dp_cp":
            return tuple(at(c["pp"], i, c["tp"]) for i in range(d.dp_shard * d.cp))
        if dim == "ep":
            base = c["edp"] * d.ep
            return tuple(at(c["pp"], base + i, c["tp"]) for i in range(d.ep))
        # edp: same ep index, every EP block
        return tuple(at(c["pp"], i * d.ep + c["ep"], c["tp"]) for i in range(self.size("edp")))

    # ---- groups -----------------------------------------------------------------------
    def group(self, dim: str) -> Group:
        """This rank's ``dim`` group (created by :meth:`init_process_groups`)."""
        dim = _dim(dim)
        ranks = self.group_ranks(dim)
        return Group(dim, ranks, ranks.index(self.global_rank), self._names.get(dim))

    def init_process_groups(self, created: Optional[dict] = None) -> "DeviceMesh":
        """Create this rank's backend group for every dimension, once.

        Only member ranks create a group (a non-member call hangs or breaks later ops on
        MindSpore's CPU backend), and every rank walks the dimensions in the same order, so
        members of one group always create it together. Groups with equal members share
        one backend group; a group of all ranks is the world group. ``created``: backend
        groups by member ranks that earlier meshes of this process created (a job laying out
        several meshes in turn), reused and added to.
        """
        if self._created:
            return self
        from mindtrain.parallel import collectives

        by_ranks: dict[tuple[int, ...], Optional[str]] = {} if created is None else created
        for dim in DIMS:
            ranks = self.group_ranks(dim)
            if ranks not in by_ranks:
                by_ranks[ranks] = collectives.new_group(ranks)
            self._names[dim] = by_ranks[ranks]
        self._created = True
        return self

    def __repr__(self) -> str:
        d = self.dims
        return (f"DeviceMesh(world={d.world_size}, pp={d.pp}, dp_shard={d.dp_shard}, cp={d.cp}, "
                f"tp={d.tp}, ep={d.ep}, rank={self.global_rank}, coords={self.coords()})")


def _dim(dim: str) -> str:
    dim = _ALIASES.get(dim, dim)
    if dim not in DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}; use one of {', '.join(DIMS)}")
    return dim
