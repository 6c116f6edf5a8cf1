"""Mesh resolution, coordinates and group membership, pure Python (no msrun)."""

import pytest

from mindtrain.config import ConfigError, ParallelDims, ParallelismConfig, UserError
from mindtrain.parallel.mesh import DeviceMesh


def mesh(world, rank=0, **kw):
    return DeviceMesh.from_config(ParallelismConfig(**kw), world, rank)


def test_dp_takes_what_remains():
    m = mesh(8, tensor_parallel=2, pipeline_parallel=2)
    assert (m.size("pp"), m.size("dp"), m.size("cp"), m.size("tp")) == (2, 2, 1, 2)
    assert m.size("dp_shard") == m.size("dp") == 2


def test_coordinates_follow_pp_dp_cp_tp_order():
    # world 16 = pp2 x dp2 x cp2 x tp2; rank = ((pp*2 + dp)*2 + cp)*2 + tp
    for r in range(16):
        m = mesh(16, r, tensor_parallel=2, context_parallel=2, pipeline_parallel=2, data_parallel_shard=2)
        c = m.coords()
        assert r == ((c["pp"] * 2 + c["dp"]) * 2 + c["cp"]) * 2 + c["tp"]
        assert m.rank("tp") == c["tp"] and m.rank("world") == r


def test_groups_partition_the_world_and_contain_the_rank():
    kw = dict(tensor_parallel=2, context_parallel=2, data_parallel_shard=2, expert_parallel=2)
    world = 8
    for dim in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp", "dense", "dense_replica", "world"):
        seen = {}
        for r in range(world):
            m = mesh(world, r, **kw)
            g = m.group(dim)
            assert g.ranks[g.index] == r and len(g.ranks) == m.size(dim)
            seen.setdefault(g.ranks, set()).add(r)
        for ranks, members in seen.items():
            assert set(ranks) == members  # every member computes the same group
        assert sorted(r for ranks in seen for r in ranks) == list(range(world))


def test_known_groups():
    m = mesh(8, 5, tensor_parallel=2, expert_parallel=4)  # dp4 x tp2; rank 5 = dp2 tp1
    assert m.group("tp").ranks == (4, 5)
    assert m.group("dp").ranks == (1, 3, 5, 7)
    assert m.group("ep").ranks == (1, 3, 5, 7) and m.rank("ep") == 2
    assert m.group("edp").ranks == (5,)
    m2 = mesh(8, 5, tensor_parallel=2, expert_parallel=2)
    assert m2.group("ep").ranks == (5, 7) and m2.group("edp").ranks == (1, 5)
    m3 = mesh(8, 6, context_parallel=2, pipeline_parallel=2)  # pp2 dp2 cp2
    assert m3.group("pp").ranks == (2, 6) and m3.group("cp").ranks == (6, 7)
    assert m3.group("dp").ranks == (4, 6) and m3.group("dp_cp").ranks == (4, 5, 6, 7)


def test_hsdp_groups():
    """dense_fsdp_shard_size: consecutive dp ranks shard the dense weights (``dense``), the dp
    ranks at the same position of every such group hold the same shard (``dense_replica``)."""
    m = mesh(8, 5, tensor_parallel=2, dense_fsdp_shard_size=2)  # dp4 x tp2; rank 5 = dp2 tp1
    assert m.group("dp").ranks == (1, 3, 5, 7)
    assert m.group("dense").ranks == (5, 7) and m.group("dense_replica").ranks == (1, 5)
    plain = mesh(8, 5, tensor_parallel=2)  # without HSDP: dense = dp, no replicas
    assert plain.group("dense").ranks == (1, 3, 5, 7) and plain.group("dense_replica").ranks == (5,)
    assert mesh(4, 0, dense_fsdp_shard_size=4).dims.dense_shard == 0  # = dp: plain FSDP
    for kw, needle in ((dict(dense_fsdp_shard_size=3), "parallelism.dense_fsdp_shard_size: 3 must divide"),
                       (dict(dense_fsdp_shard_size=0), "parallelism.dense_fsdp_shard_size: must be a positive")):
        with pytest.raises(ConfigError, match=needle):
            mesh(4, 0, **kw)
    # with pipeline and context parallelism (issue 34): the groups stay within a stage's
    # data-parallel ranks at one CP index
    m = mesh(16, 13, pipeline_parallel=2, context_parallel=2, dense_fsdp_shard_size=2)  # pp2 dp4 cp2
    assert m.group("dp").ranks == (9, 11, 13, 15)
    assert m.group("dense").ranks == (13, 15) and m.group("dense_replica").ranks == (9, 13)


def test_from_parallel_dims():
    dims = ParallelDims(world_size=4, pp=1, dp_shard=2, cp=1, tp=2, ep=1)
    assert DeviceMesh.from_config(dims, 4, 3).group("dp").ranks == (1, 3)


@pytest.mark.parametrize("world,rank,kw,needle", [
    (4, 0, dict(tensor_parallel=3), "does not divide the 4 devices"),
    (4, 0, dict(data_parallel_shard=3), "= 3, but 4 devices"),
    (8, 0, dict(data_parallel_shard=2, tensor_parallel=2), "= 4, but 8 devices"),
    (4, 0, dict(expert_parallel=3), "parallelism.expert_parallel: 3 must divide"),
    (8, 0, dict(tensor_parallel=2, expert_parallel=8), "must divide data_parallel_shard x context_parallel"),
    (4, 0, dict(tensor_parallel=0), "parallelism.tensor_parallel: must be a positive integer"),
    (4, 0, dict(pipeline_parallel=-1), "parallelism.pipeline_parallel: must be a positive integer"),
    (4, 0, dict(context_parallel=-2), "parallelism.context_parallel: must be a positive integer"),
    (4, 0, dict(expert_parallel=0), "parallelism.expert_parallel: must be a positive integer"),
    (4, 0, dict(data_parallel_shard=0), "data_parallel_shard: must be a positive integer or -1"),
    (4, 0, dict(tensor_parallel=2.0), "parallelism.tensor_parallel: must be an integer"),
    (4, 4, dict(), "rank 4 is outside the world of 4"),
    (4, -1, dict(), "rank -1 is outside"),
    (0, 0, dict(), "world size must be >= 1"),
])
def test_illegal_layouts_have_one_line_errors(world, rank, kw, needle):
    with pytest.raises(UserError) as e:
        mesh(world, rank, **kw)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.parametrize("dims,needle", [
    (dict(world_size=4, pp=1, dp_shard=2, cp=1, tp=1, ep=1), "= 2, but 4 devices are running"),
    (dict(world_size=4, pp=1, dp_shard=4, cp=1, tp=1, ep=3), "3 must divide"),
    (dict(world_size=4, pp=1, dp_shard=4, cp=1, tp=0, ep=1), "tensor_parallel: must be a positive integer"),
])
def test_illegal_parallel_dims(dims, needle):
    # the rules live once, in mindtrain.config: ParallelDims checks itself when made
    with pytest.raises(ConfigError, match=needle):
        ParallelDims(**dims)
    with pytest.raises(ConfigError, match="resolved for 4 workers, but 2"):
        DeviceMesh.from_config(ParallelDims(4, 1, 4, 1, 1, 1), 2, 0)


def test_unknown_dimension():
    with pytest.raises(ValueError, match="unknown mesh dimension 'xp'"):
        mesh(2).rank("xp")


def test_mesh_import_does_not_load_mindspore():
    import subprocess
    import sys

    code = "import sys, mindtrain.parallel.mesh; assert 'mindspore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
