"""The layout as a value (trainer.parallel.dims): its axes, what it derives, its meshes' names, its sizes."""

import pytest

from checkpointing.errors import ConfigError
from orchestrator.config import ElasticConfig, check_sizes
from trainer.config.load import load_config
from trainer.parallel.dims import AXES, DERIVED, Axis, Mesh, ParallelDims, fixed_degree, valid_world_sizes


def dims(world, *overrides):
    return ParallelDims.from_config(load_config(None, ["train.global_batch=8", "train.micro_batch=1", *overrides]),
                                    world)


def test_axes_are_the_mesh_dimension_names_with_room_for_cp_and_ep():
    assert [str(a) for a in AXES] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert Axis.EP not in AXES  # carved from dp_shard, not a dimension of its own
    assert {a.value for a in Axis} == {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"}
    assert Axis.TP == "tp" and f"{Axis.DP_SHARD}" == "dp_shard" and type(str(Axis.TP)) is str
    d = dims(4)
    assert (d.cp, d.ep) == (1, 1)
    assert d.coords(3) == {"tp": 0, "dp_shard": 3, "dp_replicate": 0, "pp": 0}
    assert ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=2, cp=2).coords(7) == {
        "tp": 1, "cp": 1, "dp_shard": 1, "dp_replicate": 0, "pp": 0}


@pytest.mark.parametrize("world, overrides, zero, shards, dp", [
    (1, ["parallel.zero_stage=3"], 0, 1, 1),          # nothing to shard across: stage 0 in effect
    (2, ["parallel.zero_stage=3", "parallel.tp=2"], 0, 1, 1),
    (4, ["parallel.zero_stage=1"], 1, 4, 4),
    (4, ["parallel.zero_stage=0"], 0, 1, 4),
    (8, ["parallel.zero_stage=2", "parallel.dp_replicate=2"], 2, 4, 8),
    (8, ["parallel.zero_stage=3", "parallel.tp=2"], 3, 4, 4),
])
def test_effective_zero_stage_and_data_parallel_size_are_derived_once(world, overrides, zero, shards, dp):
    d = dims(world, *overrides)
    assert (d.zero_stage, d.zero_shards, d.dp, d.uses_fsdp) == (zero, shards, dp, zero == 3)
    assert d.world_size == world


def test_derived_meshes_are_named_and_sized_from_their_axes():
    assert DERIVED[Mesh.DP] == (Axis.DP_REPLICATE, Axis.DP_SHARD)
    assert DERIVED[Mesh.DP_SHARD_CP] == (Axis.DP_SHARD, Axis.CP)
    d = dims(8, "parallel.dp_replicate=2")
    assert (d.size(Mesh.DP), d.size(Mesh.DP_SHARD_CP), d.size(Mesh.DP_CP), d.size("tp")) == (8, 4, 8, 1)
    assert d.loss_mesh == Mesh.DP
    with_cp = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=2, cp=2)
    assert with_cp.world_size == 8 and with_cp.dp == 2 and with_cp.size(Mesh.DP_SHARD_CP) == 4
    assert with_cp.loss_mesh == Mesh.DP_CP


def test_ep_is_carved_from_dp_shard():
    assert ParallelDims(pp=1, dp_replicate=1, dp_shard=4, tp=1, ep=2).world_size == 4
    with pytest.raises(ConfigError, match="ep=3 is carved from dp_shard=4"):
        ParallelDims(pp=1, dp_replicate=1, dp_shard=4, tp=1, ep=3)


def test_valid_sizes_come_from_the_fixed_degree_and_the_batch():
    assert fixed_degree(dp_replicate=2, tp=2, pp=1) == 4 and fixed_degree(2, 2, 1, cp=2) == 8
    cfg = load_config(None, ["parallel.tp=2", "train.global_batch=8", "train.micro_batch=2"])
    assert valid_world_sizes(cfg, 16) == [2, 4, 8]
    with pytest.raises(ConfigError, match=r"multiples of dp_replicate x tp x pp \(here 1 x 2 x 1 = 2\)"):
        check_sizes(cfg, ElasticConfig(workers=3, min_workers=3, max_workers=3))
