"""What the trainer tests train: a small fx-traceable CNN on a learnable synthetic image set.

    images(n, seed)          x (n, 3, 16, 16) float, y (n,) in [0, 10): shared class templates
    small_cnn()              CifarCNN(channels=(8, 16), hidden=32): ~9k parameters
    make_trainer(**config)   get_trainer with Adam(lr=1e-2) on a fresh small_cnn (seeded), progress off
    run(directory, stop_at)  train DATA (100 images, 3 steps of 32 per epoch) with checkpoints; with
                             stop_at the run dies after that step, as a killed job would
    weights(model)           {name: tensor} detached copies, to compare runs
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from examples.cifar10.data import synthetic_cifar
from examples.cifar10.model import CifarCNN
from replica.defaults import default_config
from replica.train.trainer import Trainer, get_trainer

IMAGE_SIZE = 16


def images(num_samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_cifar(num_samples, image_size=IMAGE_SIZE, seed=seed)


def small_cnn(dropout: bool = False) -> torch.nn.Module:
    model = CifarCNN(channels=(8, 16), hidden=32, image_size=IMAGE_SIZE)
    if dropout:
        model.classifier.insert(3, torch.nn.Dropout(0.3))  # between the hidden ReLU and the last Linear
    return model


def make_trainer(*, model_seed: int = 0, dropout: bool = False, lr: float = 1e-2,
                 optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                 loss: Any = None, **config: Any) -> Trainer:
    torch.manual_seed(model_seed)
    model = small_cnn(dropout)
    config.setdefault("progress", False)
    opt = optimizer(model) if optimizer is not None else torch.optim.Adam(model.parameters(), lr=lr)
    return get_trainer(config=default_config(**config), model=model,
                       loss=torch.nn.CrossEntropyLoss() if loss is None else loss, optimizer=opt)


DATA = synthetic_cifar(100, image_size=IMAGE_SIZE, seed=0)  # batches of 32, 32 and 36: 3 steps per epoch
EPOCHS = 3  # 9 steps


class Stop(Exception):
    """Raised by a step callback: the run 'dies' right after a step."""


def run(directory: str | Path | None, *, stop_at: int | None = None, epochs: int = EPOCHS, **config: Any) -> Trainer:
    """Train on DATA, checkpointing every 2 steps into ``directory``; with ``stop_at`` the run
    dies after that step (its checkpoints stay). A run that will resume starts from another
    model seed, so everything it ends with must come from the checkpoint."""
    config.setdefault("checkpoint_every_steps", 2 if directory is not None else None)
    config.setdefault("model_seed", 0 if stop_at is not None else 1)
    trainer = make_trainer(checkpoint_dir=None if directory is None else str(directory), batch_size=32, **config)
    return train_until(trainer, stop_at, epochs)


def train_until(trainer: Trainer, stop_at: int | None, epochs: int = EPOCHS) -> Trainer:
    """Train ``trainer`` on DATA for ``epochs``, dying after step ``stop_at`` (if given)."""

    def die(t: Trainer) -> None:
        if t.step == stop_at:
            raise Stop

    try:
        trainer.train_dataset(*DATA, epochs=epochs, on_step_end=die)
    except Stop:
        pass
    return trainer


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# Another stage count or micro-batch count sums a gradient in another order (fp32 round-off,
# ~1e-7); Adam divides by sqrt(v), so a weight whose gradient is near zero can move by up to
# lr × that noise over a few steps. A real fault (state, data order) moves most weights by ~lr.
ACROSS_LAYOUTS = dict(rtol=1e-3, atol=1e-4)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tolerance: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{name}: {m}", **tolerance)
