"""Resuming a Trainer into a checkpoint directory of another model: a ``CheckpointError`` that says so and names
the fix a Trainer user has (another ``checkpoint_dir``), never ``read_weights``' own arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import replica
from examples.cifar10.model import CifarCNN
from replica.defaults import default_config
from tests.train_cases import DATA, IMAGE_SIZE, run


@pytest.mark.parametrize("on_meta", [False, True])
def test_resuming_another_models_checkpoints_names_checkpoint_dir(tmp_path: Path, on_meta: bool) -> None:
    run(tmp_path, epochs=1)  # CifarCNN(channels=(8, 16), hidden=32)
    with torch.device("meta" if on_meta else "cpu"):
        other = CifarCNN(channels=(8, 16), hidden=24, image_size=IMAGE_SIZE)  # another size of it
    trainer = replica.get_trainer(config=default_config(checkpoint_dir=str(tmp_path), batch_size=32, progress=False),
                                  model=other, loss=torch.nn.CrossEntropyLoss(),
                                  optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    with pytest.raises(replica.CheckpointError) as info:
        trainer.train_dataset(*DATA, epochs=2)
    message = str(info.value)
    assert "another model" in message and "config.checkpoint_dir" in message and "new directory" in message, message
    assert "aliases=" not in message and "all_names=" not in message, message
    # the first mis-shaped names, with both shapes (the hidden layer: 32 wide in the checkpoint, 24 here)
    first = message.split("mis-shaped")[1]
    assert first.index("classifier.1.weight") < first.index("(32, 256)") < first.index("(24, 256)"), message
