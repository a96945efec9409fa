"""One device mesh for the world, its dims named by the layout: every process group of a run is a slice of it.

The world is ``init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)``:
``(dp_replicate, dp_shard, pp, tp)``, outermost first, so that a rank's place in the mesh is
the one :meth:`replica.layout.Layout.coordinates` gives it (tensor-parallel ranks are
neighbours, one node; a data-parallel replica is ``dp_replicate × dp_shard + dp_shard``).
Slices, as torchtitan takes them:

- ``tp``: the ranks that cut one stage's blocks (DTensor);
- ``dp_shard``, or ``(dp_replicate, dp_shard)`` under HSDP: the mesh FSDP2 shards a stage over;
- ``pp``: one replica's pipeline (the output broadcast, the measured step's barrier);
- ``dp`` (``dp_replicate`` and ``dp_shard`` flattened): every replica of a stage (the
  replicated replicas' gradient average, gathering the replicas' outputs).

A weight tied across pipeline ranks (an embedding and its head on two stages) is summed over
exactly the ranks that hold it: a subset of a ``pp`` slice, which no mesh dim names, so it gets
a group of its own (:meth:`ParallelMesh.tied_group`). Every group waits at most ``timeout``
for a collective (gloo's and NCCL's own timeout, set on each group), so a dead peer ends a
step with an error instead of a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from replica.errors import ConfigError
from replica.layout import MESH_DIMS, Coordinates, Layout

__all__ = ["ParallelMesh", "build_mesh"]


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """Bound every collective of ``group`` by ``timeout`` (torch's own per-group setting)."""
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None and group is not None:
        setter(timeout, group)


@dataclass
class ParallelMesh:
    """This process's place in the world's mesh, and the groups its layout uses."""

    layout: Layout
    rank: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh, dims MESH_DIMS
    timeout: datetime.timedelta
    flat_dp: Any = None  # dp_replicate x dp_shard flattened, where both are > 1
    _tied: dict[tuple[int, ...], Any] = field(default_factory=dict)

    # --- where this rank sits ------------------------------------------------------------
    @property
    def coordinates(self) -> Coordinates:
        return self.layout.coordinates(self.rank)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_pipeline_ranks(self) -> int:
        return self.layout.pipeline_ranks

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def pipeline_rank(self) -> int:
        return self.coordinates.pipeline_rank

    @property
    def data_parallel_rank(self) -> int:
        return self.coordinates.data_parallel_rank

    @property
    def tensor_parallel_rank(self) -> int:
        return self.coordinates.tensor_parallel_rank

    def global_rank(self, pipeline_rank: int, data_parallel_rank: int | None = None,
                    tensor_parallel_rank: int | None = None) -> int:
        """The process at ``pipeline_rank`` of replica ``data_parallel_rank`` (default: this
        one's), at tensor-parallel coordinate ``tensor_parallel_rank`` (default: this one's:
        pipeline messages go between ranks of the same coordinate)."""
        dp = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        tp = self.tensor_parallel_rank if tensor_parallel_rank is None else tensor_parallel_rank
        return self.layout.global_rank(pipeline_rank, dp, tp)

    # --- slices ----------------------------------------------------------------------------
    @property
    def tensor_parallel_mesh(self) -> Any:
        return self.mesh["tp"]

    @property
    def sharding_mesh(self) -> Any:
        """The mesh FSDP2 shards a stage over: ``dp_shard``, or ``(dp_replicate, dp_shard)``
        under HSDP (shard within a group, replicate across groups)."""
        if self.layout.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    @property
    def pipeline_group(self) -> Any:
        return self.mesh.get_group("pp")

    @property
    def data_parallel_group(self) -> Any:
        """Every replica of this rank's stages (None with one replica)."""
        if self.layout.data_parallel_size == 1:
            return None
        if self.layout.dp_shard == 1:
            return self.mesh.get_group("dp_replicate")
        if self.layout.dp_replicate == 1:
            return self.mesh.get_group("dp_shard")
        return self.flat_dp.get_group()

    def tied_group(self, members: Sequence[int]) -> Any:
        """A group of exactly ``members`` (global ranks, in one order on every rank): made by
        every rank of the world, in the same order (``new_group`` is collective), the first
        time any rank asks; None where this rank is not among them."""
        key = tuple(members)
        if key not in self._tied:
            self._tied[key] = dist.new_group(list(key), timeout=self.timeout)
        return self._tied[key] if self.rank in key else None


def build_mesh(layout: Layout, device_type: str, timeout: datetime.timedelta) -> ParallelMesh:
    """The world's mesh for ``layout``: every rank of the process group calls this alike."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.world_size != world:
        raise ConfigError(
            f"the plan lays out {layout.world_size} processes ({layout.describe()}) but this process group has "
            f"{world}; re-plan for this world"
        )
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
    flat = None
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        _set_timeout(flat.get_group(), timeout)
    for name in MESH_DIMS:
        _set_timeout(mesh.get_group(name), timeout)
    return ParallelMesh(layout=layout, rank=rank, mesh=mesh, timeout=timeout, flat_dp=flat)
