"""A Chrome-trace timeline per rank (JSON Trace Event Format, opens in https://ui.perfetto.dev and
chrome://tracing): one span per step phase on the rank's "steps" track and one span per gradient bucket's
collective on its "communication" track, for the batches `profiling.begin_on_batch`..`end_after_batch`.

Times are wall-clock microseconds (the timer's clock shifted to time.time()), so the timelines of ranks on
one machine line up when opened together.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TIMELINE_TEMPLATE = "timeline/rank-{rank}.trace.json"  # relative to the run dir
STEP_TRACK, COMM_TRACK = 0, 1


class Timeline:
    """Collects spans of the profiled batches and writes them as one Chrome-trace file."""

    def __init__(self, *, rank: int, path: Path, begin_on_batch: int, end_after_batch: int | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.rank = rank
        self.path = path
        self.begin = begin_on_batch
        self.end = end_after_batch
        self._offset = time.time() - clock()  # timer clock -> wall clock
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": STEP_TRACK, "args": {"name": "steps"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": COMM_TRACK, "args": {"name": "communication"}},
        ]
        self.written = False

    def covers(self, step: int) -> bool:
        return step >= self.begin and (self.end is None or step <= self.end)

    def is_last(self, step: int) -> bool:
        return self.end is not None and step >= self.end

    def _micros(self, seconds: float) -> float:
        return round((seconds + self._offset) * 1e6, 1)

    def span(self, name: str, start: float, end: float, step: int, track: int = STEP_TRACK,
             args: dict[str, Any] | None = None) -> None:
        if not self.covers(step) or self.written:
            return
        self.events.append({"name": name, "cat": "comm" if track == COMM_TRACK else "step", "ph": "X",
                            "pid": self.rank, "tid": track, "ts": self._micros(start),
                            "dur": round((end - start) * 1e6, 1), "args": {"step": step, **(args or {})}})

    def step_span(self, step: int, start: float, end: float) -> None:
        self.span(f"step {step}", start, end, step, args={"phase": "step"})

    def bucket_spans(self, step: int, spans: list[tuple[int, float, float | None]]) -> None:
        for index, ready, done in spans:
            if done is not None:
                self.span(f"allreduce bucket {index}", ready, done, step, track=COMM_TRACK, args={"bucket": index})

    def write(self) -> Path:
        """Write the file atomically (once; later calls do nothing) and return its path."""
        if not self.written:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")  # unique per file, whatever its suffix
            partial.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
            os.replace(partial, self.path)
            self.written = True
        return self.path
