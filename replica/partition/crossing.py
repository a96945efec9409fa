"""What crosses a cut under autocast: a value that every reader casts to the compute dtype crosses already cast.

Under bf16 / fp16 autocast an fp32 value (a norm's output, say) whose readers are all ops that
autocast runs in half precision (linears, matmuls, convolutions, attention) is cast by each of
them before use. Cast once by the stage that makes it instead, it crosses the cut, and is held
by the stage that reads it, in half the bytes, and every reader computes exactly what it did
(autocast's cast of a half-precision value is the value). Its gradient comes back in that
dtype: one reader's is the same, several readers' are summed in it (round-off of the compute
dtype). A value some reader takes in fp32 (a residual stream, read by a norm and an add) crosses
as it is. The planner prices the cast size (:func:`crossing_dtype`), and
:func:`replica.partition.split.split` casts where the plan's boundary dtype says so.
"""

from __future__ import annotations

from typing import Sequence

from replica.partition.graph import OP, Node, TensorInfo

__all__ = ["crossing_dtype", "crossing_bytes"]

HALF = ("bfloat16", "float16")
# ops autocast runs in its half-precision dtype, casting their floating inputs first (its
# "lower_precision_fp" lists, CPU and CUDA): the traced graph's names
CASTS_INPUTS = frozenset({"linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "conv1d", "conv2d", "conv3d",
                          "convolution", "scaled_dot_product_attention"})


def crossing_dtype(value: Node, readers: Sequence[Node]) -> str | None:
    """The dtype ``value`` crosses a cut in, read by ``readers`` on the other side: the compute
    dtype they all cast it to, where it is fp32 and each is such an op; else its own."""
    if len(value.outputs) != 1 or not readers:
        return value.outputs[0].dtype if len(value.outputs) == 1 else None
    own = value.outputs[0].dtype
    if own != "float32":
        return own
    dtypes = {r.compute_dtype for r in readers}
    if len(dtypes) != 1 or not dtypes <= set(HALF):
        return own
    if any(r.kind != OP or r.target.split(".")[0].lstrip("_") not in CASTS_INPUTS for r in readers):
        return own
    return dtypes.pop()


def crossing_bytes(value: Node, readers: Sequence[Node]) -> int:
    """Bytes of ``value`` as it crosses a cut to ``readers`` (:func:`crossing_dtype`)."""
    dtype = crossing_dtype(value, readers)
    if dtype is None or dtype == value.outputs[0].dtype:
        return value.output_bytes
    return TensorInfo(value.outputs[0].shape, dtype).nbytes
