"""The ``replica`` command: plan a model, or export a checkpoint's weights, from the shell."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, Sequence

from replica.errors import ReplicaError

__all__ = ["main"]


def _load_factory(spec: str) -> Any:
    """``package.module:function`` or ``path/to/file.py:function``."""
    if ":" not in spec:
        raise ReplicaError(f"expected MODULE:FACTORY (e.g. examples.gpt.model:example), got {spec!r}")
    module_name, func = spec.rsplit(":", 1)
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        sys.path.insert(0, str(path.parent))
        module_name = path.stem
    else:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ReplicaError(f"cannot import {module_name!r}: {exc}") from exc
    if not hasattr(module, func):
        raise ReplicaError(f"{module_name} has no {func!r}; it must return (model, example_inputs)")
    return getattr(module, func)


def _plan(args: argparse.Namespace) -> int:
    import replica

    built = _load_factory(args.factory)()
    if not (isinstance(built, tuple) and len(built) >= 2):
        raise ReplicaError(f"{args.factory} must return (model, example_inputs), got {type(built).__name__}")
    model, inputs = built[0], built[1]
    plan = replica.plan(model, inputs, world_size=args.world_size, num_stages=args.num_stages,
                        num_microbatches=args.num_microbatches, schedule=args.schedule, device=args.device,
                        cost=args.cost)
    print(plan.summary())
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"plan written to {args.json}")
    if args.html:
        from replica.viz.report import visualize

        visualize(plan, args.html)
        print(f"report written to {args.html}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from replica.checkpoint.export import export_safetensors

    written = export_safetensors(args.checkpoint, args.out_dir, max_shard_bytes=args.max_shard_size,
                                 overwrite=args.overwrite)
    print(f"exported {_exported_step(written)} to {written}; add the model's config "
          f"(config.save_pretrained({str(args.out_dir)!r})) to load it with from_pretrained")
    return 0


def _exported_step(written: Path) -> str:
    """``step 12 (checkpoints/step-00000012)``: what the exported file's metadata record."""
    import json

    from safetensors import safe_open

    if written.suffix == ".json":
        meta = json.loads(written.read_text()).get("metadata", {})
    else:
        with safe_open(str(written), "pt") as f:
            meta = f.metadata() or {}
    return f"step {meta.get('replica_step', '?')} ({meta.get('replica_checkpoint', 'a checkpoint')})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replica", description="Automatic pipeline parallelism for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="trace, price and partition a model; print the plan")
    p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs); meta tensors welcome")
    p.add_argument("--world-size", type=int)
    p.add_argument("--num-stages", type=int)
    p.add_argument("--num-microbatches", type=int)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--device", help="cpu, a100-80gb, h100-80gb (default: where the model lives)")
    p.add_argument("--cost", default="auto", choices=["auto", "analytic", "profile"])
    p.add_argument("--json", help="also write the plan as JSON here")
    p.add_argument("--html", help="also write the plan report (one self-contained HTML file) here")
    p.set_defaults(run=_plan)
    e = commands.add_parser("export", help="write a checkpoint's weights as a Hugging Face model.safetensors")
    e.add_argument("checkpoint", help="a checkpoint_dir (its newest good step) or one step-XXXXXXXX directory")
    e.add_argument("out_dir", help="the directory to write model.safetensors (or shards and their index) into")
    e.add_argument("--max-shard-size", help="split into shards of at most this size: bytes, or e.g. 5GB, 500MiB")
    e.add_argument("--overwrite", action="store_true", help="replace weights out_dir already holds")
    e.set_defaults(run=_export)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ReplicaError as exc:
        print(f"replica: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
