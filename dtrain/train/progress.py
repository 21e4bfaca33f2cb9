"""Rank 0's console: a progress bar (step, loss, samples/s, ETA) on a terminal, plain lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

log = logging.getLogger("dtrain")


class Progress:
    """One bar for the whole run; `note` prints a line above it (validation results, warnings)."""

    def __init__(self, total_batches: int, done_batches: int, global_batch_size: int, enabled: bool,
                 report_every: int = 100) -> None:
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
        self.global_batch_size = global_batch_size
        self.total = total_batches
        self.report_every = report_every
        self._start_time = time.perf_counter()
        self._start_step = done_batches
        self._earlier_samples = 0  # trained at earlier global batch sizes (batch-size schedule)
        self._bar = (tqdm(total=total_batches, initial=done_batches, unit="batch", dynamic_ncols=True,
                          mininterval=0.5, smoothing=0.05, file=sys.stderr) if self.interactive else None)

    def samples_per_second(self, step: int) -> float:
        elapsed = time.perf_counter() - self._start_time
        samples = self._earlier_samples + (step - self._start_step) * self.global_batch_size
        return samples / elapsed if elapsed > 0 else 0.0

    def change_global_batch(self, step: int, global_batch_size: int) -> None:
        """From batch `step` on, batches hold `global_batch_size` records (a batch-size schedule grew them)."""
        self._earlier_samples += (step - self._start_step) * self.global_batch_size
        self._start_step = step
        self.global_batch_size = global_batch_size

    def update(self, step: int, epoch_of: Callable[[int], float], loss: Any) -> None:
        """Record that `step` batches are done; `loss` is this rank's latest training loss (a scalar tensor or a
        number). Epoch and loss are only worked out when shown, every `report_every` batches and at the end (reading
        a loss on a GPU waits for the device: never per batch)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        if step % self.report_every == 0 or step == self.total:  # the loss is read at report boundaries only
            self._show(step, epoch_of, loss)

    def _show(self, step: int, epoch_of: Callable[[int], float], loss: Any) -> None:
        """The bar's figures, or a plain line: epoch, loss (read here) and samples/s after batch `step`."""
        figures = f"epoch {epoch_of(step):.2f} loss {_number(loss):.4f} {self.samples_per_second(step):,.0f} samples/s"
        if self._bar is not None:
            self._bar.set_postfix_str(figures, refresh=False)
        else:
            self.note(f"batch {step}/{self.total} {figures}")

    def pause_clock(self, seconds: float) -> None:
        """Leave time spent outside training (validation, checkpoints) out of samples/s."""
        self._start_time += seconds

    def note(self, line: str) -> None:
        if not self.enabled:
            return
        log.info(line)
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _number(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


class ConsoleHandler(logging.Handler):
    """Rank 0's log lines on the console, printed above a progress bar instead of through it.

    Records logged with `extra={"console": False}` stay in the log file only.
    """

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True) is False:
            return
        try:
            tqdm.write(f"dtrain: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)
        except Exception:  # a broken console must not stop training
            self.handleError(record)
