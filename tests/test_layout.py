"""The layout: one schedule registry, one validated Layout, one rank formula."""

from __future__ import annotations

import pytest

import replica
from replica.layout import SCHEDULE_KINDS, TUNED_SCHEDULES, Coordinates, Layout, schedule_kind, schedule_names
from replica.schedules.schedule import make_schedule, placement, splits_backward


@pytest.mark.parametrize("name", list(SCHEDULE_KINDS))
def test_the_registry_describes_what_each_generator_makes(name):
    kind = SCHEDULE_KINDS[name]
    layout = Layout.for_stages(name, 2 * kind.stages_per_rank)
    schedule = make_schedule(name, layout.num_stages, 4, layout.pipeline_ranks)
    assert len(schedule) == layout.pipeline_ranks
    where = placement(schedule)
    assert [sum(1 for r in where.values() if r == rank) for rank in range(len(schedule))] == \
        [kind.stages_per_rank] * layout.pipeline_ranks
    assert splits_backward(schedule) == kind.splits_backward
    if kind.placement == "v":
        assert where == {0: 0, 1: 1, 2: 1, 3: 0}
    if kind.placement == "looped":
        assert where == {0: 0, 1: 1, 2: 0, 3: 1}


def test_every_name_check_reads_the_registry():
    assert schedule_names() == sorted(SCHEDULE_KINDS) and schedule_names(auto=True) == sorted([*SCHEDULE_KINDS, "auto"])
    assert set(TUNED_SCHEDULES) == set(SCHEDULE_KINDS)
    assert schedule_kind("ZB-V").name == "zb-v"
    with pytest.raises(replica.ConfigError, match=r"unknown schedule 'pipedream'; choose one of \['1f1b', 'auto'"):
        schedule_kind("pipedream")
    with pytest.raises(replica.ConfigError, match="schedule must be a string, got int"):
        schedule_kind(3)
    with pytest.raises(replica.ConfigError, match=r"unknown schedule 'pipedream'; choose one of .*None: the tuner"):
        replica.defaults.default_config(schedule="pipedream")


def test_rank_coordinates_round_trip():
    layout = Layout(schedule="1f1b", num_stages=4, pipeline_ranks=4, data_parallel_size=3)
    assert layout.world_size == 12 and layout.stages_per_rank == 1
    seen = []
    for rank in range(12):
        c = layout.coordinates(rank)
        assert layout.global_rank(c.pipeline_rank, c.data_parallel_rank) == rank
        seen.append((c.data_parallel_rank, c.pipeline_rank))
    assert seen == [(d, p) for d in range(3) for p in range(4)]  # a replica's stages are neighbours
    with pytest.raises(replica.ConfigError, match="rank 12 is outside this layout's world of 12"):
        layout.coordinates(12)


@pytest.mark.parametrize("schedule, world, stages, replicas, want", [
    ("1f1b", 8, None, None, (8, 8, 1)),
    ("1f1b", 8, 2, None, (2, 2, 4)),
    ("1f1b", 8, None, 2, (4, 4, 2)),
    ("interleaved", 4, None, None, (8, 4, 1)),
    ("interleaved", 4, 12, 2, (12, 2, 2)),
    ("zb-v", 4, None, 2, (4, 2, 2)),
])
def test_a_world_lays_out(schedule, world, stages, replicas, want):
    layout = Layout.for_world(schedule, world, num_stages=stages, data_parallel_size=replicas)
    assert (layout.num_stages, layout.pipeline_ranks, layout.data_parallel_size) == want
    assert layout.world_size == world


@pytest.mark.parametrize("kwargs, says", [
    (dict(schedule="1f1b", world_size=8, num_stages=3),
     r"num_stages=3 does not divide the world size 8.*\[1, 2, 4, 8\]"),
    (dict(schedule="1f1b", world_size=8, num_stages=2, data_parallel_size=2),
     "num_stages=2 on 8 ranks leaves 4 data-parallel replicas, not data_parallel_size=2"),
    (dict(schedule="1f1b", world_size=6, data_parallel_size=4),
     "data_parallel_size=4 does not divide the world size 6"),
    (dict(schedule="interleaved", world_size=4, num_stages=4), "needs num_stages a multiple of 4 larger than 4"),
    (dict(schedule="zb-v", world_size=4, num_stages=6), "num_stages must be 8, got 6"),
])
def test_a_world_that_does_not_fit_says_what_would(kwargs, says):
    schedule, world = kwargs.pop("schedule"), kwargs.pop("world_size")
    with pytest.raises(replica.ConfigError, match=says):
        Layout.for_world(schedule, world, **kwargs)


def test_a_layout_is_validated_once_where_it_is_made():
    with pytest.raises(replica.ConfigError, match="3 stages need 3 pipeline ranks, got 2"):
        Layout(schedule="gpipe", num_stages=3, pipeline_ranks=2)
    with pytest.raises(replica.ConfigError, match="data_parallel_size must be a positive int, got 0"):
        Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=0)
    two_d = Layout(schedule="1f1b", num_stages=1, pipeline_ranks=1, data_parallel_size=2, tensor_parallel_size=2,
                   sharding="zero3")  # FSDP x TP on one mesh
    assert two_d.mesh_shape == (1, 2, 1, 2) and (two_d.dp_shard, two_d.dp_replicate) == (2, 1)
    tp = Layout(schedule="1f1b", num_stages=2, pipeline_ranks=2, data_parallel_size=2, tensor_parallel_size=2)
    assert tp.world_size == 8 and tp.coordinates(5) == Coordinates(pipeline_rank=0, data_parallel_rank=1,
                                                                      tensor_parallel_rank=1)
    assert [tp.global_rank(1, 1, t) for t in range(2)] == [6, 7]  # the shards of a stage are neighbours
    assert Layout(schedule="GPipe", num_stages=1, pipeline_ranks=1).schedule == "gpipe"
