"""Checkpoints on disk: atomic, checksummed step directories by original names, and their export to Hugging Face."""

from replica.checkpoint.store import CheckpointError
from replica.checkpoint.tensors import load_into_plain_model

__all__ = ["CheckpointError", "load_into_plain_model"]
