"""Train the CIFAR-10 CNN through Replica's trainer: the seed's front door, split into pipeline stages.

    python examples/cifar10/train.py --data-dir ~/data/cifar-10-batches-py      # the real data set
    python examples/cifar10/train.py --synthetic                                 # a generated stand-in
    torchrun --nproc-per-node 2 examples/cifar10/train.py --synthetic            # 2 stages on 2 ranks

The real data are the standard python batches (``data_batch_1..5``, ``test_batch``) from
cifar-10-python.tar.gz, extracted by you: this script never downloads anything.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `replica` and `examples` import uninstalled

import replica  # noqa: E402
from examples.cifar10.data import find_cifar10, load_cifar10, synthetic_cifar  # noqa: E402
from examples.cifar10.model import CifarCNN  # noqa: E402
from replica.defaults import default_config  # noqa: E402
from replica.train.elastic import init_process_group  # noqa: E402
from replica.train.trainer import get_trainer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data/cifar-10-batches-py", help="where data_batch_1..5 and test_batch are")
    p.add_argument("--synthetic", action="store_true", help="train on a generated, learnable stand-in instead")
    p.add_argument("--synthetic-size", type=int, default=10_000, help="training images in the stand-in")
    p.add_argument("--limit", type=int, default=None, help="train on the first N images only (a quick look)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-stages", type=int, default=None, help="default: 1 in one process, one per rank")
    p.add_argument("--num-microbatches", type=int, default=None)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--checkpoint-dir", default=None, help="save here, and resume from here if it holds checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (default: per epoch)")
    p.add_argument("--metrics-file", default=None, help="append JSONL metrics here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default: torch's choice")
    return p.parse_args()


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if args.synthetic:
        x_train, y_train = synthetic_cifar(args.synthetic_size, seed=args.seed)
        x_test, y_test = synthetic_cifar(max(1, args.synthetic_size // 5), seed=args.seed + 1)
        return x_train, y_train, x_test, y_test
    if find_cifar10(args.data_dir) is None:
        print(f"CIFAR-10 not found in {args.data_dir}: expected data_batch_1 .. data_batch_5 and test_batch "
              "(the python version, cifar-10-python.tar.gz, extracted). This script never downloads; fetch and "
              "extract it yourself and pass --data-dir, or run with --synthetic for a generated stand-in.",
              file=sys.stderr)
        sys.exit(2)
    return load_cifar10(args.data_dir)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one process per rank
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    x_train, y_train, x_test, y_test = load_data(args)  # (N, 3, 32, 32) float, (N,) long
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    if rank == 0:
        print(f"{len(x_train)} training and {len(x_test)} test images"
              f"{' (synthetic)' if args.synthetic else ''}")

    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = CifarCNN()
    config = default_config(num_stages=args.num_stages, num_microbatches=args.num_microbatches,
                            schedule=args.schedule, batch_size=args.batch_size, seed=args.seed,
                            checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=args.checkpoint_every,
                            metrics_file=args.metrics_file,
                            device="cuda" if torch.cuda.is_available() else None)
    trainer = get_trainer(config=config, model=model, loss=torch.nn.CrossEntropyLoss(),
                          optimizer=torch.optim.Adam(model.parameters(), lr=args.lr))
    start = time.perf_counter()
    trainer.train_dataset(x_train, y_train, epochs=args.epochs)
    accuracy = trainer.evaluate(x_test, y_test)
    if rank == 0:
        print(trainer.pipeline.plan.summary() if trainer.pipeline.plan.num_stages > 1 else trainer.pipeline)
        print(f"test accuracy {accuracy:.2%} after {trainer.epoch} epochs ({trainer.step} steps, "
              f"{time.perf_counter() - start:.0f} s)")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except replica.ReplicaError as exc:  # a bad setting: say what and how to fix it, without a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
