"""Errors a user can act on: each names the problem, the numbers and the fix."""

from __future__ import annotations


class ReplicaError(ValueError):
    """Base class of every error Replica raises for bad input or a failed run."""


class ConfigError(ReplicaError):
    """An argument or configuration value is out of range or inconsistent."""


class TraceError(ReplicaError):
    """The model could not be captured as a graph."""


class PartitionError(ReplicaError):
    """No partition satisfies the request (too many stages, not enough memory)."""


class ScheduleError(ReplicaError):
    """A schedule is malformed: a missing action, a duplicate, or a deadlock."""


class PipelineError(ReplicaError):
    """A pipelined step could not run (missing loss function, bad batch, dead peer)."""
