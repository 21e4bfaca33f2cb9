"""The Chrome-trace timeline: valid Trace Event Format JSON, spans in microseconds on the rank's tracks, bucket
spans named per bucket, and only the batches of the profiling window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dtrain.config import Profiling
from dtrain.profile import timeline as timeline_module
from dtrain.profile.profiler import Profiler
from dtrain.profile.timeline import COMM_TRACK, STEP_TRACK, TIMELINE_TEMPLATE, Timeline

WALL_AT_START = 1_000.0  # time.time() when the timeline is made; the fake timer clock reads 0.0 then


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The file's events, after checking the Trace Event Format rules the viewers rely on."""
    trace = json.loads(path.read_text())
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    events: list[dict[str, Any]] = trace["traceEvents"]
    for event in events:
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event["name"], str) and isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert isinstance(event["tid"], int)
            assert isinstance(event["ts"], float) and isinstance(event["dur"], float) and event["dur"] >= 0
    return events


def spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event["ph"] == "X"]


@pytest.fixture
def fixed_wall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline_module.time, "time", lambda: WALL_AT_START)


@pytest.mark.usefixtures("fixed_wall")
def test_spans_are_microseconds_of_wall_time_on_the_rank_tracks(tmp_path: Path) -> None:
    timeline = Timeline(rank=3, path=tmp_path / "t" / "rank-3.trace.json", begin_on_batch=0, end_after_batch=None,
                        clock=lambda: 0.0)
    timeline.span("forward", 2.0, 2.5, step=1)
    timeline.step_span(1, 1.75, 3.0)
    timeline.bucket_spans(1, [(0, 2.25, 2.625), (1, 2.5, None), (2, 2.5, 3.0)])
    path = timeline.write()
    assert path == tmp_path / "t" / "rank-3.trace.json" and not path.with_suffix(".partial").exists()
    events = read_trace(path)
    names = {(e["name"], e.get("tid"), e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert names == {("process_name", None, "rank 3"), ("thread_name", STEP_TRACK, "steps"),
                     ("thread_name", COMM_TRACK, "communication")}
    got = [(e["name"], e["pid"], e["tid"], e["cat"], e["ts"], e["dur"], e["args"]) for e in spans(events)]
    assert got == [
        ("forward", 3, STEP_TRACK, "step", (WALL_AT_START + 2.0) * 1e6, 0.5e6, {"step": 1}),
        ("step 1", 3, STEP_TRACK, "step", (WALL_AT_START + 1.75) * 1e6, 1.25e6, {"step": 1, "phase": "step"}),
        ("allreduce bucket 0", 3, COMM_TRACK, "comm", (WALL_AT_START + 2.25) * 1e6, 0.375e6, {"step": 1, "bucket": 0}),
        ("allreduce bucket 2", 3, COMM_TRACK, "comm", (WALL_AT_START + 2.5) * 1e6, 0.5e6, {"step": 1, "bucket": 2}),
    ]  # bucket 1 never finished: no span


@pytest.mark.usefixtures("fixed_wall")
def test_only_the_window_is_recorded_and_the_file_is_written_once(tmp_path: Path) -> None:
    timeline = Timeline(rank=0, path=tmp_path / "rank-0.trace.json", begin_on_batch=2, end_after_batch=3,
                        clock=lambda: 0.0)
    assert [timeline.covers(step) for step in range(1, 5)] == [False, True, True, False]
    assert [timeline.is_last(step) for step in range(1, 5)] == [False, False, True, True]
    for step in range(1, 5):
        timeline.span("data", float(step), step + 0.5, step)
    timeline.write()
    timeline.span("data", 2.0, 2.5, 2)  # after the write: ignored
    first = timeline.path.read_text()
    assert timeline.write() == timeline.path and timeline.path.read_text() == first
    assert [e["args"]["step"] for e in spans(read_trace(timeline.path))] == [2, 3]
    open_ended = Timeline(rank=0, path=tmp_path / "x.json", begin_on_batch=0, end_after_batch=None, clock=lambda: 0.0)
    assert open_ended.covers(10**9) and not open_ended.is_last(10**9)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_the_profiler_writes_the_window_with_phases_buckets_and_exposed_wait(tmp_path: Path) -> None:
    profiler = Profiler(Profiling(enabled=True, begin_on_batch=2, end_after_batch=3), rank=1, run_dir=tmp_path)
    clock = FakeClock()
    profiler.timer.clock = profiler.timer.buckets.clock = clock
    path = tmp_path / TIMELINE_TEMPLATE.format(rank=1)
    starts: dict[int, float] = {}
    for step in range(1, 5):
        starts[step] = clock.now
        with profiler.step(step, records=16):
            with profiler.phase("forward"):
                clock.advance(0.25)
            with profiler.phase("backward"):
                clock.advance(0.125)
                slot = profiler.timer.buckets.bucket_ready(0)
                clock.advance(0.125)
                last = profiler.timer.buckets.bucket_ready(1)  # the last bucket is ready 0.5 s into the step
                clock.advance(0.0625)
                profiler.timer.buckets.bucket_done(slot)
                clock.advance(0.125)
                profiler.timer.buckets.bucket_done(last)  # done 0.1875 s after the last ready: the exposed wait
            with profiler.phase("optimizer"):
                clock.advance(0.0625)
        assert path.is_file() == (step >= 3)  # written as soon as the window's last batch ends
    written = path.read_text()
    assert profiler.close() == [str(path)] and path.read_text() == written  # listed for the summary, not rewritten
    events = spans(read_trace(path))
    assert sorted({e["args"]["step"] for e in events}) == [2, 3]
    assert all(e["pid"] == 1 for e in events)
    step2 = {e["name"]: e for e in events if e["args"]["step"] == 2}
    assert set(step2) == {"forward", "backward", "optimizer", "comm_wait", "allreduce bucket 0",
                          "allreduce bucket 1", "step 2"}
    exposed = 0.1875
    # the backward span is the whole backward pass; its exposed wait shows as a span nested at its end
    expected_dur = {"forward": 0.25, "backward": 0.4375, "optimizer": 0.0625, "comm_wait": exposed,
                    "allreduce bucket 0": 0.1875, "allreduce bucket 1": exposed, "step 2": 0.75}
    for name, seconds in expected_dur.items():
        assert step2[name]["dur"] == pytest.approx(seconds * 1e6, abs=0.1), name
    origin = step2["step 2"]["ts"] - starts[2] * 1e6  # the wall-clock shift, the same for every span
    expected_start = {"forward": 0.0, "backward": 0.25, "allreduce bucket 0": 0.375, "allreduce bucket 1": 0.5,
                      "comm_wait": 0.5, "optimizer": 0.6875}  # seconds after the step began
    for name, seconds in expected_start.items():
        assert step2[name]["ts"] - origin == pytest.approx((starts[2] + seconds) * 1e6, abs=1.0), name
    assert step2["allreduce bucket 1"]["tid"] == COMM_TRACK and step2["comm_wait"]["tid"] == STEP_TRACK


def test_a_run_that_ends_inside_the_window_writes_on_close(tmp_path: Path) -> None:
    profiler = Profiler(Profiling(enabled=True), rank=0, run_dir=tmp_path)
    assert profiler.close() == []  # no span yet: nothing worth a file
    with profiler.step(1, records=4):
        with profiler.phase("forward"):
            pass
    [written] = profiler.close()
    assert Path(written) == tmp_path / TIMELINE_TEMPLATE.format(rank=0)
    assert [e["name"] for e in spans(read_trace(Path(written)))] == ["forward", "step 1"]
