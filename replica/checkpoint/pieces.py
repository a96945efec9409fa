"""A DTensor whose share DCP cannot describe as one chunk (a fused q/k/v weight's ``_StridedShard``), in pieces.

DCP describes a rank's share of a DTensor as one box (offsets and sizes). A fused q/k/v
projection cut for tensor parallelism holds every part's slice — rows ``[r*P/t, (r+1)*P/t)``
of each of the ``k`` parts of ``P`` rows — so its share is ``k`` boxes, and DCP's one box would
overlap the next rank's. :func:`as_pieces` hands DCP those boxes instead, through the hooks
a DTensor itself implements (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), on a tensor that shares the local shard's storage: saving writes each
box, loading fills each box in place. Which global indices a rank holds is DTensor's own
answer, worked out locally per sharded dimension on an index vector (no communication).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

__all__ = ["needs_pieces", "as_pieces", "snapshot"]

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # global offsets, sizes, local offsets


def needs_pieces(t: torch.Tensor) -> bool:
    """Whether DCP would describe ``t``'s share wrongly: a DTensor with a strided placement."""
    return isinstance(t, DTensor) and any(type(p).__name__ == "_StridedShard" for p in t.placements)


def _cuts(placement: Any, dim: int) -> bool:
    """Whether ``placement`` (``Shard``, ``_StridedShard``: not a subclass) cuts tensor dimension ``dim``."""
    return getattr(placement, "dim", None) == dim


def _held_indices(t: DTensor, dim: int) -> list[int]:
    """The global indices along ``dim`` this rank holds, as DTensor lays them out (local: each rank
    cuts its own index vector, ``src_data_rank=None``)."""
    shape = [1] * t.dim()
    shape[dim] = t.shape[dim]
    index = torch.arange(t.shape[dim], device=t.to_local().device).reshape(shape)
    placements = [p if _cuts(p, dim) else Replicate() for p in t.placements]
    return distribute_tensor(index, t.device_mesh, placements, src_data_rank=None).to_local().reshape(-1).tolist()


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """``(global start, length, local start)`` of each run of consecutive indices."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][1] == g:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        else:
            runs.append((g, 1, local))
    return runs


def _boxes(t: DTensor) -> list[Box]:
    per_dim = [_runs(_held_indices(t, d)) if any(_cuts(p, d) for p in t.placements)
               else [(0, t.shape[d], 0)] for d in range(t.dim())]
    boxes: list[Box] = [((), (), ())]
    for runs in per_dim:
        boxes = [(o + (g,), s + (n,), lo + (loc,)) for o, s, lo in boxes for g, n, loc in runs]
    return [b for b in boxes if all(b[1])]


class _Pieces(torch.Tensor):
    """A local shard (same storage) that tells DCP it is several boxes of a global tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # every op on it: a plain tensor

    _local: torch.Tensor
    _global: torch.Size
    _boxes: list[Box]

    def size(self, dim: Any = None) -> Any:  # DCP compares the global size with the checkpoint's
        return self._global if dim is None else self._global[dim]

    def _view(self, box: Box) -> torch.Tensor:
        view = self._local
        for d, (start, length) in enumerate(zip(box[2], box[1])):
            view = view.narrow(d, start, length)
        return view

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self._boxes]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self._local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(o),
                                                                                 sizes=torch.Size(s)),
                                                      properties=properties, size=self._global))
                for o, s, _ in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for box in self._boxes:
            if index.offset is not None and tuple(index.offset) == box[0]:
                return self._view(box)
        raise ValueError(f"{index.fqn}: this rank holds no piece at {index.offset}")


def _pieces(local: torch.Tensor, global_shape: torch.Size, boxes: list[Box]) -> torch.Tensor:
    out = torch.Tensor._make_subclass(_Pieces, local, False)
    out._local, out._global, out._boxes = local, global_shape, boxes
    return out


def as_pieces(t: DTensor) -> torch.Tensor:
    """``t``'s local shard (sharing its storage) described to DCP box by box."""
    return _pieces(t.to_local().detach(), t.shape, _boxes(t))


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the CPU as DCP sees it (a DTensor's or pieces' local shard, told to DCP
    box by box), for a save that goes on in the background while training changes ``t``."""
    if isinstance(t, _Pieces):
        return _pieces(t._local.to("cpu", copy=True), t._global, t._boxes)
    if isinstance(t, DTensor):
        return _pieces(t.to_local().detach().to("cpu", copy=True), t.shape, _boxes(t))
    return t.detach().to("cpu", copy=True)
