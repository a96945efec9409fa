"""Train a small byte-level GPT on Python's own sources, split into pipeline stages by Replica.

    python examples/gpt/train.py                   # 4 stages, 4 micro-batches, 1F1B, about 2 minutes on 2 CPU cores
    python examples/gpt/train.py --data input.txt --steps 2000 --schedule gpipe
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `replica` and `examples` import uninstalled

import replica  # noqa: E402
from examples.gpt.data import VOCAB_SIZE, decode, encode, get_batch, load_corpus, train_val_split  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, loss_fn  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="a text file; default: the standard library's .py sources")
    p.add_argument("--max-bytes", type=int, default=3_000_000, help="read at most this much text")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--num-stages", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | ...")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads; default: torch's choice")
    return p.parse_args()


@torch.no_grad()
def estimate_loss(pm, data: torch.Tensor, args: argparse.Namespace, num_batches: int = 8) -> float:
    generator = torch.Generator().manual_seed(args.seed + 1)  # the same windows every time
    losses = []
    for _ in range(num_batches):
        x, y = get_batch(data, args.batch_size, args.block_size, generator)
        logits = pm(x)  # (B, T, vocab_size): the pipelined forward, called like the model
        losses.append(loss_fn(logits, y).item())
    return sum(losses) / len(losses)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    # Data: bytes in, bytes out.
    data = load_corpus(args.data, args.max_bytes)
    train_data, val_data = train_val_split(data)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"corpus: {len(data):,} bytes ({len(train_data):,} train, {len(val_data):,} val)")

    # Model: a plain nn.Module, written without a thought of pipelining.
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=VOCAB_SIZE,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    model = GPT(config)
    print(f"model: {model.num_parameters():,} parameters")

    # Replica traces the model, prices it, cuts it into stages and schedules the micro-batches.
    x_example, _ = get_batch(train_data, args.batch_size, args.block_size, torch.Generator().manual_seed(0))
    pm = replica.auto_parallel(
        model,
        (x_example,),
        num_stages=args.num_stages,
        num_microbatches=args.num_microbatches,
        schedule=args.schedule,
        loss_fn=loss_fn,
    )
    print(pm.plan.summary())

    # pm.parameters() are the model's own parameters, so any optimizer works unchanged.
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.99))
    tokens_per_step = args.batch_size * args.block_size
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = get_batch(train_data, args.batch_size, args.block_size, generator)  # (B, T), (B, T)
        optimizer.zero_grad(set_to_none=True)
        loss = pm.train_step(x, y)  # every micro-batch forward and backward; mean loss over the batch
        optimizer.step()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - t0
            print(f"step {step:5d} | loss {float(loss):.4f} | {tokens_per_step * step / elapsed:,.0f} tokens/s")
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f}s")

    model.eval()
    print(f"val loss {estimate_loss(pm, val_data, args):.4f}")

    # Sampling is eager and token by token, so it uses the plain model: same parameters, no pipeline.
    prompt = encode("def ")[None, :]  # (1, T)
    sample = model.generate(prompt, args.sample_tokens, temperature=0.8, top_k=50,
                            generator=torch.Generator().manual_seed(args.seed))
    print("-" * 60)
    print(decode(sample[0]))
    print("-" * 60)


if __name__ == "__main__":
    main()
