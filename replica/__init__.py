"""Replica: automatic pipeline model parallelism for PyTorch."""

from replica import defaults
from replica.amp import GradScaler
from replica.api import PipelineModel, auto_parallel, plan
from replica.checkpoint.export import export_safetensors
from replica.checkpoint.store import CheckpointError
from replica.checkpoint.tensors import load_into_plain_model
from replica.errors import (
    ConfigError,
    PartitionError,
    PipelineError,
    ReplicaError,
    ScheduleError,
    TraceError,
)
from replica.layout import Layout
from replica.materialize import deferred_init, materialize
from replica.partition.cost import DeviceSpec
from replica.partition.plan import Plan
from replica.planner.options import PlannerOptions
from replica.process_group import init_process_group
from replica.runtime.heap import keep_freed_memory
from replica.train.trainer import Trainer, get_trainer
from replica.viz.report import visualize

__version__ = "0.1.0"

__all__ = [
    "auto_parallel",
    "plan",
    "visualize",
    "get_trainer",
    "Trainer",
    "defaults",
    "load_into_plain_model",
    "export_safetensors",
    "CheckpointError",
    "Plan",
    "Layout",
    "materialize",
    "deferred_init",
    "PlannerOptions",
    "PipelineModel",
    "DeviceSpec",
    "keep_freed_memory",
    "init_process_group",
    "ReplicaError",
    "ConfigError",
    "TraceError",
    "PartitionError",
    "ScheduleError",
    "PipelineError",
    "GradScaler",
]
