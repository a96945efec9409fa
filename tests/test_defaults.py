"""TrainerConfig: the documented defaults, and a ConfigError naming the value and the fix for each bad one."""

from __future__ import annotations

import dataclasses

import pytest

import replica
from replica.defaults import TrainerConfig, default_config


def test_the_defaults_are_the_documented_ones() -> None:
    c = default_config()
    assert (c.num_stages, c.num_microbatches, c.schedule, c.data_parallel_size) == (None, None, None, None)  # None: the tuner's choice
    assert (c.batch_size, c.shuffle, c.seed, c.device, c.progress) == (32, True, 0, None, True)
    assert (c.checkpoint_dir, c.checkpoint_every_steps, c.keep_checkpoints) == (None, None, 3)
    assert (c.log_every_steps, c.metrics_file) == (10, None)


def test_fields_are_keyword_only_and_overridable() -> None:
    with pytest.raises(TypeError):
        TrainerConfig(4)  # type: ignore[misc]
    assert default_config(batch_size=64, schedule="gpipe").batch_size == 64


@pytest.mark.parametrize(("field", "value", "says"), [
    ("num_stages", 0, "num_stages must be a positive int or None, got 0"),
    ("num_microbatches", -2, "got -2"),
    ("data_parallel_size", 1.5, "got 1.5"),
    ("batch_size", 0, "batch_size must be a positive int, got 0"),
    ("batch_size", True, "got True"),
    ("keep_checkpoints", 0, "keep_checkpoints must be a positive int"),
    ("log_every_steps", -1, "log_every_steps"),
    ("schedule", "fastest", "unknown schedule 'fastest'; choose one of"),
    ("shuffle", "yes", "shuffle must be True or False"),
    ("progress", 1, "progress must be True or False"),
    ("checkpoint_dir", "", "empty string"),
    ("metrics_file", 3, "metrics_file must be a path"),
    ("seed", -1, "seed must be an int in [0, 2**63)"),
    ("device", "gpu:0", "unknown device 'gpu:0'"),
    ("device", "cuda:x", "is not a torch device"),
    ("timeout_s", 0, "timeout_s must be a number of seconds > 0"),
    ("num_microbatches", 64, "num_microbatches=64 but batch_size=32"),
])
def test_a_bad_value_raises_config_error(field: str, value: object, says: str) -> None:
    with pytest.raises(replica.ConfigError, match=None) as info:
        default_config(**{field: value})
    assert says in str(info.value)
    assert isinstance(info.value, replica.ReplicaError) and isinstance(info.value, ValueError)


def test_checkpoint_every_steps_needs_a_directory() -> None:
    with pytest.raises(replica.ConfigError, match="set checkpoint_dir="):
        default_config(checkpoint_every_steps=100)
    assert default_config(checkpoint_every_steps=100, checkpoint_dir="ckpt").checkpoint_every_steps == 100


def test_unknown_fields_are_named() -> None:
    with pytest.raises(replica.ConfigError, match=r"no field\(s\) \['epochs'\]; the fields are"):
        default_config(epochs=3)


def test_replace_checks_again() -> None:
    with pytest.raises(replica.ConfigError, match="batch_size"):
        dataclasses.replace(default_config(), batch_size=-1)
