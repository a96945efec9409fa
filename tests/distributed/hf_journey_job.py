"""The journey of issue #45 as README tells it, for one launcher attempt: a tiny Hugging Face Llama
built on meta, its weights read from a ``save_pretrained`` directory, the Trainer in bf16 on two
pipeline stages, checkpoints into a directory; rank 1 dies (``SIGKILL``) after step
``KILL_AFTER`` of the first attempt, and torchrun's restart resumes.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/distributed/hf_journey_job.py OUT_DIR

``OUT_DIR/tiny-llama`` holds the model (:func:`save_model`); checkpoints go to ``OUT_DIR/checkpoints``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

import replica  # noqa: E402
from replica.defaults import default_config  # noqa: E402

VOCAB, SEQ = 64, 12
STEPS = 4  # one epoch of 4 batches of 8
CHECKPOINT_EVERY = 2
KILL_AFTER = 3  # the checkpoint of step 2 is the newest when rank 1 dies


def save_model(out: Path) -> None:
    """A tiny Llama's config and random weights, as ``save_pretrained`` leaves them (use_cache on)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(out / "tiny-llama")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (8 * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]  # each position's label: the next token


def main() -> None:
    import transformers

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    config = transformers.AutoConfig.from_pretrained(out / "tiny-llama")
    config.use_cache = False  # training needs no key/value cache
    with replica.deferred_init():  # parameters on meta, buffers (rotary inv_freq) real
        model = transformers.LlamaForCausalLM(config)
    trainer = replica.get_trainer(
        config=default_config(num_stages=2, batch_size=8, mixed_precision="bf16", log_every_steps=1,
                              checkpoint_dir=str(out / "checkpoints"), checkpoint_every_steps=CHECKPOINT_EVERY,
                              timeout_s=60),
        model=model, loss=torch.nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        weights=out / "tiny-llama")

    def die(t: replica.train.trainer.Trainer) -> None:
        if t.step == KILL_AFTER and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.train_dataset(*batch(), epochs=1, on_step_end=die)
    # one write, the newline in it: two ranks' print()s (text, then newline) interleave on the shared pipe
    sys.stdout.flush()
    os.write(1, f"rank {os.environ['RANK']} ended at step {trainer.step}, resumed from "
                f"{None if trainer.resumed_from is None else trainer.resumed_from.name}\n".encode())


if __name__ == "__main__":
    main()
