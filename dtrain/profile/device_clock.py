"""The device's side of the phase timers on a GPU: CUDA events recorded on the current stream at each phase's
start and end, read once the GPU has passed them (a step or more later), so that timing a phase never makes the
CPU wait for the GPU. `synchronize` is the old way (`profiling.sync_timings: true`): wait for the device at every
phase's end, which keeps the CPU from queueing work ahead of the GPU."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class DeviceClock(Protocol):
    """What the timers need from a device: marks in its work queue, whether it has passed one, the seconds between
    two, and a full wait for it."""

    def mark(self) -> Any: ...

    def done(self, mark: Any) -> bool: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def release(self, mark: Any) -> None: ...

    def synchronize(self) -> None: ...


class CudaClock:
    """CUDA events with timing on the current stream of `device`, kept in a pool for reuse (one event per phase
    start and end; creating one costs a driver call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.cuda.Event] = []

    def mark(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def done(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())  # cudaEventQuery: no wait

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # returns at once for an event the GPU has passed
        return start.elapsed_time(end) / 1e3

    def release(self, mark: torch.cuda.Event) -> None:
        self._free.append(mark)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
