"""Replica: automatic pipeline model parallelism for PyTorch."""

from replica.api import PipelineModel, auto_parallel, plan
from replica.errors import (
    ConfigError,
    PartitionError,
    PipelineError,
    ReplicaError,
    ScheduleError,
    TraceError,
)
from replica.partition.cost import DeviceSpec
from replica.partition.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "auto_parallel",
    "plan",
    "Plan",
    "PipelineModel",
    "DeviceSpec",
    "ReplicaError",
    "ConfigError",
    "TraceError",
    "PartitionError",
    "ScheduleError",
    "PipelineError",
]
