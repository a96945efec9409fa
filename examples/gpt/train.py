"""Train a small byte-level GPT on Python's own sources, split into pipeline stages by Replica.

    python examples/gpt/train.py                   # 4 stages, 4 micro-batches, 1F1B, about 2 minutes on 2 CPU cores
    python examples/gpt/train.py --data input.txt --steps 2000 --schedule gpipe
    python examples/gpt/train.py --precision bf16   # bfloat16 autocast; fp16 adds replica.GradScaler
    python examples/gpt/train.py --compile on       # every stage through torch.compile (auto: on for a GPU)
    torchrun --nproc-per-node 2 examples/gpt/train.py --threads 1   # 2 ranks over gloo, laid out by Replica

Under torchrun (one node or several) every rank runs this same script, on the same batches;
rank 0 prints. With more ranks than stages (``--num-stages 2`` on 4 ranks) the rest are
data-parallel replicas: each trains its slice of every ``--batch-size`` batch, so the
losses are those of one process training the same batches. The script never works out a
layout: Replica does.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `replica` and `examples` import uninstalled

import replica  # noqa: E402
from examples.gpt.data import VOCAB_SIZE, decode, encode, get_batch, load_corpus, train_val_split  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402
from replica.train.elastic import init_process_group  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="a text file; default: the standard library's .py sources")
    p.add_argument("--max-bytes", type=int, default=3_000_000, help="read at most this much text")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=16, help="windows per step, over every data-parallel replica")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--num-stages", type=int, default=None,
                   help="default: 4 in one process; under torchrun, one per rank (two for interleaved / zb-v)")
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | zb-h1 | interleaved | zb-v | auto")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="what the stages compute in: fp32, or bf16 / fp16 autocast (fp32 weights and AdamW state; "
                   "fp16 scales the loss with replica.GradScaler)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile each stage: auto = the planner's rule (on for a GPU, off on a CPU, where "
                   "inductor's C++ build costs 10-20 s a graph), on / off = compile=True / False")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default: torch's choice")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="CPU: glibc keeps freed memory for the next micro-batch (replica.keep_freed_memory; "
                   "on in benchmarks)")
    p.add_argument("--trainer", action="store_true",
                   help="train through replica.get_trainer (the Keras-like front door) instead of the loop")
    return p.parse_args()


def compile_choice(args: argparse.Namespace) -> bool | None:
    """``--compile`` as auto_parallel's ``compile``: None (the planner's rule), True or False."""
    return {"auto": None, "on": True, "off": False}[args.compile]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to a tenth of --lr."""
    warmup_steps = max(1, args.steps // 20)
    if step < warmup_steps:
        return args.lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, args.steps - warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def estimate_loss(pm: replica.PipelineModel, data: torch.Tensor, args: argparse.Namespace, num_batches: int = 8) -> float:
    """The mean loss over ``num_batches`` fixed windows of ``data``, through the pipeline (under
    ``--precision``'s autocast, as in training); the loss itself in fp32."""
    generator = torch.Generator().manual_seed(args.seed + 1)  # the same windows every time
    device = next(pm.model.parameters()).device
    losses = []
    for _ in range(num_batches):
        x, y = get_batch(data, args.batch_size, args.block_size, generator)  # (B, T), (B, T)
        logits = pm(x.to(device))  # (B, T, vocab_size): the pipelined forward, on every rank
        losses.append(loss_fn(logits.float(), y.to(device)).item())
    return sum(losses) / len(losses)


def first_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def whole_model(pm: replica.PipelineModel, model: GPT) -> GPT:
    """The trained weights in one plain GPT. In one process that is ``model`` itself; under
    torch.distributed each rank holds only its stages, so their weights are gathered."""
    if not torch.distributed.is_initialized():
        return model
    parts: list[dict[str, torch.Tensor] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, {k: v.detach().cpu() for k, v in pm.state_dict().items()})
    whole = GPT(model.config)
    whole.load_state_dict({k: v for part in parts if part for k, v in part.items()})
    return whole


def train_with_trainer(model: GPT, train_data: torch.Tensor, val_data: torch.Tensor,
                       args: argparse.Namespace, say: Callable[..., None] = print) -> None:
    """The same training through replica.get_trainer: windows of the corpus as a data set."""
    windows = torch.Generator().manual_seed(args.seed)
    x, y = get_batch(train_data, args.steps * args.batch_size, args.block_size, windows)  # (N, T), (N, T)
    x_val, y_val = get_batch(val_data, 8 * args.batch_size, args.block_size, windows)
    config = replica.defaults.default_config(
        num_stages=args.num_stages, num_microbatches=args.num_microbatches, schedule=args.schedule,
        batch_size=args.batch_size, seed=args.seed, log_every_steps=args.log_every,
        mixed_precision=args.precision,  # fp16: the Trainer steps through its own replica.GradScaler
        compile=compile_choice(args),
    )
    trainer = replica.get_trainer(config=config, model=model, loss=loss_fn,
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    trainer.train_dataset(x, y, epochs=1)
    say(f"val loss {trainer.evaluate(x_val, y_val):.4f}")


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        replica.keep_freed_memory()  # process-wide: fewer page faults between micro-batches on CPU
    device = torch.device("cpu")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one process per rank
        if torch.cuda.is_available():  # NCCL carries CUDA tensors: each rank on its node's GPU
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        init_process_group("nccl" if device.type == "cuda" else "gloo")
    say = print if first_rank() else (lambda *_, **__: None)  # rank 0 speaks for all
    if args.num_stages is None and args.schedule != "auto" and not torch.distributed.is_initialized():
        args.num_stages = 4  # one process: four stages (under torchrun: Replica lays out the world)
    torch.manual_seed(args.seed)  # every rank builds the same initial model

    # Data: bytes in, bytes out.
    data = load_corpus(args.data, args.max_bytes)
    train_data, val_data = train_val_split(data)
    generator = torch.Generator().manual_seed(args.seed)
    say(f"corpus: {len(data):,} bytes ({len(train_data):,} train, {len(val_data):,} val)")

    # Model: a plain nn.Module, written without a thought of pipelining.
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=VOCAB_SIZE,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    model = GPT(config).to(device)  # the same weights on every rank: built under the same seed
    say(f"model: {model.num_parameters():,} parameters")

    if args.trainer:
        train_with_trainer(model, train_data, val_data, args, say)
    else:
        train_with_loop(model, train_data, val_data, generator, args, say)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_with_loop(model: GPT, train_data: torch.Tensor, val_data: torch.Tensor, generator: torch.Generator,
                    args: argparse.Namespace, say: Callable[..., None]) -> None:
    """The plain loop: auto_parallel, an ordinary optimizer, train_step; then a sample."""
    device = next(model.parameters()).device  # a CPU, or this rank's GPU under torchrun
    # Replica traces the model, prices it, cuts it into stages and schedules the micro-batches.
    x_example, _ = get_batch(train_data, args.batch_size, args.block_size, torch.Generator().manual_seed(0))
    pm = replica.auto_parallel(
        model,
        (x_example.to(device),),  # the batch the plain model takes, on every rank
        num_stages=args.num_stages,
        num_microbatches=args.num_microbatches,
        schedule=args.schedule,
        loss_fn=loss_fn,
        mixed_precision=args.precision,  # "fp32": no autocast; "bf16" / "fp16": each stage's forward under autocast
        compile=compile_choice(args),  # None: on for a GPU, off on a CPU; the summary's "compile:" line says which
    )
    say(pm.plan.summary())

    # pm.parameters() are the model's own parameters (those this rank holds), so any optimizer works unchanged.
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.99))
    # fp16 needs loss scaling (small gradients underflow otherwise); replica.GradScaler agrees
    # across ranks on whether a step overflowed, so every rank skips or steps together
    scaler = replica.GradScaler(device=device.type) if args.precision == "fp16" else None
    tokens_per_step = args.batch_size * args.block_size
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        x, y = get_batch(train_data, args.batch_size, args.block_size, generator)  # (B, T), (B, T)
        optimizer.zero_grad(set_to_none=True)
        # every micro-batch forward and backward; the mean loss over the global batch
        loss = pm.train_step(x.to(device), y.to(device), scaler=scaler)  # the loss returned is unscaled
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)  # unscales the gradients; skips the step if any rank's overflowed
            scaler.update()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - t0
            scale = "" if scaler is None else f" | loss scale {scaler.get_scale():.0f}"
            say(f"step {step:4d} | loss {float(loss):.4f} | lr {learning_rate(step, args):.2e} | "
                f"{tokens_per_step * (step + 1) / elapsed:,.0f} tokens/s{scale}")
    say(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f}s")

    pm.eval()  # also the plain model: the stages share its modules
    say(f"val loss {estimate_loss(pm, val_data, args):.4f}")

    # Sampling is eager and token by token, so it uses the plain model: same parameters, no pipeline.
    plain = whole_model(pm, model)
    if first_rank():
        prompt = encode("def ")[None, :]  # (1, T)
        sample = plain.generate(prompt, args.sample_tokens, temperature=0.8, top_k=50,
                                generator=torch.Generator().manual_seed(args.seed))
        print("-" * 60)
        print(decode(sample[0]))
        print("-" * 60)


if __name__ == "__main__":
    main()
