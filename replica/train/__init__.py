"""Training on top of the pipeline: the Keras-like ``Trainer``, its checkpoints, and torchrun set-up."""

from replica.checkpoint.store import CheckpointError
from replica.checkpoint.tensors import load_into_plain_model
from replica.train.elastic import init_process_group
from replica.train.trainer import Trainer, get_trainer

__all__ = ["Trainer", "get_trainer", "load_into_plain_model", "CheckpointError", "init_process_group"]
