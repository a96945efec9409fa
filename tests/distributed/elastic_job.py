"""A training job that loses a rank mid-save on its first attempt; torchrun restarts it and it resumes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 1 \\
        tests/distributed/elastic_job.py OUT_DIR

As a new user writes it, from README: no process group started by hand (the Trainer starts
it from torchrun's environment). Rank 1 is killed (``SIGKILL``, as ``kill -9``) in the middle of
writing its share of the checkpoint of step ``CRASH_STEP`` on attempt 0
(``TORCHELASTIC_RESTART_COUNT``); the others then fail waiting for it, torchrun restarts them
all, and the trainer resumes from the newest complete checkpoint in ``OUT_DIR/checkpoints``
(``LAST_GOOD``: the half-written step is never published).
Each rank of each attempt that finishes writes ``OUT_DIR/attempt{A}-rank{R}.json``. With
``--data-parallel-size 3`` every rank fails alike at planning: rank 0 prints the error, the
others a line each.
:func:`train` runs the same training in one process: the uninterrupted reference.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

from examples.cifar10.data import synthetic_cifar  # noqa: E402
from examples.cifar10.model import CifarCNN  # noqa: E402
from replica.defaults import default_config  # noqa: E402
from replica.train.trainer import Trainer, get_trainer  # noqa: E402

NUM_SAMPLES = 240  # 7 full batches of 32 and one of 16, merged into the 7th: 7 steps per epoch
EPOCHS = 2
CHECKPOINT_EVERY = 3
CRASH_STEP = 6  # while saving step 6, mid-epoch 0
LAST_GOOD = 3


def train(checkpoint_dir: str | Path, *, num_stages: int | None = None, progress: bool = False,
          data_parallel_size: int | None = None, on_step_end: Callable[[Trainer], None] | None = None) -> Trainer:
    """The job: a small CNN on synthetic images, Adam, checkpoints every few steps."""
    torch.manual_seed(0)
    model = CifarCNN(channels=(4, 8), hidden=16, image_size=16)
    x, y = synthetic_cifar(NUM_SAMPLES, image_size=16, seed=0)
    config = default_config(num_stages=num_stages, data_parallel_size=data_parallel_size, batch_size=32,
                            checkpoint_dir=str(checkpoint_dir), checkpoint_every_steps=CHECKPOINT_EVERY,
                            progress=progress, log_every_steps=2, seed=3, timeout_s=30)
    trainer = get_trainer(config=config, model=model, loss=torch.nn.CrossEntropyLoss(),
                          optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    trainer.train_dataset(x, y, epochs=EPOCHS, on_step_end=on_step_end)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--data-parallel-size", type=int, help="a bad one (3 of 4 ranks): the error, read once")
    args = parser.parse_args()
    out = Path(args.out_dir)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    if attempt == 0 and rank == 1:
        half_written = out / "checkpoints" / f".tmp-step-{CRASH_STEP:08d}"
        save = torch.save

        def crash(obj, f, *args, **kwargs):  # DCP writes the rank's shards (and its RNG file) with torch.save
            if half_written.is_dir():
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no clean-up, no goodbye to the other ranks
            return save(obj, f, *args, **kwargs)

        torch.save = crash

    trainer = train(out / "checkpoints", progress=True, data_parallel_size=args.data_parallel_size)
    # the process group: started by the trainer
    report = {"attempt": attempt, "rank": rank, "step": trainer.step,
              "resumed_from": None if trainer.resumed_from is None else trainer.resumed_from.name}
    (out / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
