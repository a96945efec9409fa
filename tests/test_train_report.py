"""What the Trainer prints off a terminal (a log file, torchrun's output): one line of the layout and where the
weights came from at start, a plain line every ``log_every_steps`` steps, one per epoch."""

from __future__ import annotations

import torch

import replica
from replica.defaults import default_config
from tests.train_cases import images, make_trainer, small_cnn


def test_off_a_terminal_the_layout_weights_and_step_lines_are_printed(capsys) -> None:
    x, y = images(64)
    trainer = make_trainer(batch_size=16, num_stages=2, log_every_steps=2, progress=True)
    trainer.train_dataset(x, y, epochs=2)  # 4 steps an epoch
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("replica: 1 process: 2 pipeline x 1 data, 2 stages, 1f1b, ") and \
        lines[0].endswith("micro-batches per replica, fp32; weights: the model's own"), lines[0]
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" (")[0] for s in steps] == ["step 2", "step 4", "step 6", "step 8"], lines
    assert steps[0].startswith("step 2 (epoch 1/2): loss ") and "samples/s, lr 0.01" in steps[0], steps[0]
    assert sum(line.startswith("epoch ") for line in lines) == 2, lines


def test_a_meta_models_weights_source_is_named(capsys) -> None:
    with replica.deferred_init():
        model = small_cnn()
    trainer = replica.get_trainer(config=default_config(batch_size=16, log_every_steps=100), model=model,
                                  loss=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.train_dataset(*images(32), epochs=1)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("weights: initialized by reset_parameters() from rank 0's seed"), first


def test_compile_seconds_are_said_and_recorded(capsys, tmp_path) -> None:
    from replica.train.report import Reporter

    metrics = tmp_path / "m.jsonl"
    reporter = Reporter(enabled=True, progress=True, log_every_steps=1, metrics_file=metrics)
    reporter.compiled(step=1, seconds=12.34, first=True, cache="/tmp/torchinductor_me")
    reporter.compiled(step=7, seconds=1.5, first=False, cache=None)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["compile: 12.3 s in step 1, torch.compile's warm-up (its step rate counts it); inductor keeps "
                     "its graphs in /tmp/torchinductor_me: a later run compiles faster",
                     "compile: 1.5 s more in step 7, for inputs not seen before (a micro-batch size new to a "
                     "static-shape stage, or a micro-batch of one sample: torch compiles it apart)"], lines
    assert '"event": "compile"' in metrics.read_text() and metrics.read_text().count("\n") == 2
