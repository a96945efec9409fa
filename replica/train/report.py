"""What the trainer tells the user: a ``rich`` progress bar per epoch and JSONL metrics, on one rank."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Reporter"]


class Reporter:
    """Progress and metrics of one process; silent unless ``enabled`` (the rank that reports).

    ``progress``: a bar on a terminal (or notebook); elsewhere a line every ``log_every_steps``
    steps and one per epoch.
    ``metrics_file``: one JSON object per line, appended, every ``log_every_steps`` steps
    (``"event": "train"``), per epoch (``"epoch"``), per evaluation and on resume.
    """

    def __init__(self, *, enabled: bool, progress: bool, log_every_steps: int,
                 metrics_file: str | os.PathLike[str] | None) -> None:
        self.enabled = enabled
        self.progress = progress and enabled
        self.log_every_steps = log_every_steps
        self.metrics_file = Path(metrics_file) if metrics_file is not None and enabled else None
        self._bar: Any = None
        self._task: Any = None
        self._window: list[tuple[float, int]] = []  # (loss × samples, samples) since the last log
        self._window_start = time.perf_counter()

    # --- records ------------------------------------------------------------------------
    def record(self, event: str, **fields: Any) -> None:
        if self.metrics_file is None:
            return
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"event": event, "time": time.time(), **fields}, sort_keys=True)
        with open(self.metrics_file, "a") as f:
            f.write(line + "\n")

    def say(self, text: str) -> None:
        if self.progress and self._bar is not None:
            self._bar.console.print(text)
        elif self.progress:
            print(text, flush=True)

    # --- an epoch -----------------------------------------------------------------------
    def start_epoch(self, epoch: int, num_epochs: int, num_batches: int | None, done: int) -> None:
        self._window, self._window_start = [], time.perf_counter()
        if not self.progress:
            return
        from rich.console import Console

        console = Console(file=sys.stderr)
        if not (console.is_terminal or console.is_jupyter):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn(f"epoch {epoch + 1}/{num_epochs}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
            TimeRemainingColumn(), console=console, transient=True,  # the epoch's summary line replaces it
        )
        self._bar.start()
        self._task = self._bar.add_task("train", total=num_batches, completed=done, loss="-", rate="-")

    def step(self, *, step: int, epoch: int, loss: float, samples: int, rate: float, lr: float | None,
             num_epochs: int | None = None) -> None:
        self._window.append((loss * samples, samples))
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=f"{loss:.4f}", rate=f"{rate:.0f}")
        if step % self.log_every_steps == 0 and self._window:
            n = sum(s for _, s in self._window)
            elapsed = time.perf_counter() - self._window_start
            mean = sum(weighted for weighted, _ in self._window) / n
            self.record("train", step=step, epoch=epoch, loss=mean,
                        samples_per_s=n / elapsed if elapsed > 0 else None, lr=lr)
            if self._bar is None:  # off a terminal (a log file, torchrun's output): a plain line instead of a bar
                of = f"/{num_epochs}" if num_epochs is not None else ""
                self.say(f"step {step} (epoch {epoch + 1}{of}): loss {mean:.4f}"
                         + (f", {n / elapsed:.0f} samples/s" if elapsed > 0 else "")
                         + (f", lr {lr:.3g}" if lr is not None else ""))
            self._window, self._window_start = [], time.perf_counter()

    def compiled(self, *, step: int, seconds: float, first: bool, cache: str | None) -> None:
        """torch.compile's seconds inside step ``step``: the warm-up (``first``), or graphs for inputs
        not seen before (a new micro-batch size)."""
        self.record("compile", step=step, seconds=seconds, first=first)
        if first:
            kept = f"; inductor keeps its graphs in {cache}: a later run compiles faster" if cache else ""
            self.say(f"compile: {seconds:.1f} s in step {step}, torch.compile's warm-up (its step rate counts it)"
                     f"{kept}")
        else:
            self.say(f"compile: {seconds:.1f} s more in step {step}, for inputs not seen before (a micro-batch "
                     "size new to a static-shape stage, or a micro-batch of one sample: torch compiles it apart)")

    def end_epoch(self, summary: dict[str, Any], num_epochs: int) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self.record("epoch", **summary)
        if summary.get("loss") is not None:
            self.say(f"epoch {summary['epoch'] + 1}/{num_epochs}: loss {summary['loss']:.4f}, "
                     f"{summary['samples_per_s']:.0f} samples/s, {summary['seconds']:.1f} s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
