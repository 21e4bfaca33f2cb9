"""Step-phase timers and the Trainer's profiler, on a fake clock: every expected figure is computed by hand from
the times the test sets, so the checks hold exactly (to float rounding) whatever the machine's load."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from dtrain.config import Profiling
from dtrain.profile.profiler import WARMUP_STEPS, Profiler, tensorboard_scalars
from dtrain.profile.timers import PHASES, BucketClock, StepRecord, StepTimer, phase_means, rank_profile

TOL = 1e-12  # the fake clock's times are sums of a few doubles


class FakeClock:
    """A clock that stands still until the test moves it."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def timed_step(timer: StepTimer, clock: FakeClock, step: int, phases: list[tuple[str, float]],
               gap: float = 0.0, records: int = 32) -> StepRecord | None:
    """One step whose phases take the given seconds in order, with `gap` untimed seconds before it ends."""
    timer.begin_step(step)
    for name, seconds in phases:
        with timer.phase(name):
            clock.advance(seconds)
    clock.advance(gap)
    timer.split_backward()
    return timer.end_step(records)


# ----------------------------------------------------------------------------------------- StepTimer


def test_the_timer_keeps_only_the_most_recent_records() -> None:
    """A long run's timer holds a bounded number of step records (the newest), not one per step forever."""
    clock = FakeClock(0.0)
    timer = StepTimer(clock=clock, max_records=3)
    for step in range(7):
        timed_step(timer, clock, step, [("forward", 0.5)])
    assert [record.step for record in timer.records] == [4, 5, 6]


def test_phases_and_the_untimed_gap_add_up_to_the_step() -> None:
    clock = FakeClock(10.0)
    timer = StepTimer(clock=clock)
    record = timed_step(timer, clock, 3, [("data", 0.25), ("forward", 0.5), ("backward", 1.0), ("optimizer", 0.125)],
                        gap=0.0625, records=48)
    assert record is not None and list(timer.records) == [record]
    assert record.step == 3 and record.start == 10.0 and record.records == 48
    assert record.seconds == pytest.approx(1.9375, abs=TOL)
    assert record.phases == pytest.approx({"data": 0.25, "forward": 0.5, "backward": 1.0, "optimizer": 0.125},
                                          abs=TOL)
    assert record.seconds - sum(record.phases.values()) == pytest.approx(0.0625, abs=TOL)


def test_a_repeated_phase_accumulates_and_a_new_step_starts_from_zero() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    first = timed_step(timer, clock, 1, [("data", 0.25), ("forward", 0.5), ("data", 0.5), ("report", 0.125),
                                         ("report", 0.25)])
    second = timed_step(timer, clock, 2, [("data", 0.125)])
    assert first is not None and second is not None
    assert first.phases == pytest.approx({"data": 0.75, "forward": 0.5, "report": 0.375}, abs=TOL)
    assert second.phases == pytest.approx({"data": 0.125}, abs=TOL)
    assert second.start == pytest.approx(first.start + first.seconds, abs=TOL)


def test_carved_waits_move_out_of_the_phase_they_happened_in_and_no_more_than_its_time() -> None:
    """FSDP's all-gathers (in forward and backward), its reduce-scatters and a pipeline's bubble become phases."""
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    timer.begin_step(1)
    with timer.phase("forward"):
        clock.advance(1.0)
        timer.carve("all_gather", 0.25)
        timer.carve("bubble", 0.5)
    with timer.phase("backward"):
        clock.advance(0.5)
        timer.carve("all_gather", 0.125)
        timer.carve("reduce_scatter", 2.0)  # more than the phase took: capped at what is left of it
    record = timer.end_step(8)
    assert record is not None
    assert record.phases == pytest.approx({"forward": 0.25, "all_gather": 0.375, "bubble": 0.5, "backward": 0.0,
                                           "reduce_scatter": 0.375}, abs=TOL)
    assert sum(record.phases.values()) == pytest.approx(1.5, abs=TOL)
    second = timed_step(timer, clock, 2, [("forward", 0.5)])  # nothing carries over to the next step
    assert second is not None and second.phases == pytest.approx({"forward": 0.5}, abs=TOL)


def test_split_backward_moves_the_wait_after_the_last_ready_bucket_into_comm_wait() -> None:
    clock = FakeClock(0.0)
    timer = StepTimer(clock=clock)
    timer.begin_step(1)
    with timer.phase("backward"):  # 0.0 .. 2.0
        clock.advance(0.5)
        first = timer.buckets.bucket_ready(0)  # ready 0.5
        clock.advance(0.5)
        second = timer.buckets.bucket_ready(1)  # ready 1.0, the last one
        clock.advance(0.25)
        timer.buckets.bucket_done(first)  # done 1.25
        clock.advance(0.5)
        timer.buckets.bucket_done(second)  # done 1.75
        clock.advance(0.25)
    with timer.phase("comm_wait"):  # already measured elsewhere: the moved time adds to it
        clock.advance(0.125)
    spans = timer.split_backward()
    record = timer.end_step(8)
    assert spans == [(0, 0.5, 1.25), (1, 1.0, 1.75)]
    exposed = 1.75 - 1.0  # max(done) - max(ready)
    assert record is not None
    assert record.phases["comm_wait"] == pytest.approx(0.125 + exposed, abs=TOL)
    assert record.phases["backward"] == pytest.approx(2.0 - exposed, abs=TOL)
    assert timer.buckets.spans == []  # taken: the next step starts with no buckets


def test_split_backward_is_capped_at_the_backward_time() -> None:
    clock = FakeClock(0.0)
    timer = StepTimer(clock=clock)
    timer.begin_step(1)
    slot = timer.buckets.bucket_ready(0)  # ready before the timed backward began (a hook on another path)
    with timer.phase("backward"):
        clock.advance(0.5)
    clock.advance(2.0)
    timer.buckets.bucket_done(slot)  # 2.5 s after ready, more than the 0.5 s of backward
    timer.split_backward()
    record = timer.end_step(8)
    assert record is not None
    assert record.phases["backward"] == pytest.approx(0.0, abs=TOL)
    assert record.phases["comm_wait"] == pytest.approx(0.5, abs=TOL)


@pytest.mark.parametrize("finish", [False, True])
def test_split_backward_moves_nothing_without_a_finished_bucket_or_with_one_done_before_the_last_ready(
        finish: bool) -> None:
    clock = FakeClock(0.0)
    timer = StepTimer(clock=clock)
    timer.begin_step(1)
    with timer.phase("backward"):
        first = timer.buckets.bucket_ready(0)
        clock.advance(0.25)
        if finish:
            timer.buckets.bucket_done(first)  # done at 0.25, before bucket 1 was ready: nothing exposed
        clock.advance(0.25)
        timer.buckets.bucket_ready(1)
        clock.advance(0.5)
    spans = timer.split_backward()
    record = timer.end_step(8)
    assert spans == [(0, 0.0, 0.25 if finish else None), (1, 0.5, None)]
    assert record is not None
    assert record.phases == pytest.approx({"backward": 1.0}, abs=TOL)


def test_split_backward_with_gradient_times_moves_the_rest_of_backward_after_the_last_gradient() -> None:
    clock = FakeClock(0.0)
    timer = StepTimer(clock=clock)
    timer.begin_step(1)
    with timer.phase("backward"):  # 0.0 .. 1.5; gradients ready at 0.25 and 0.5, then DDP waits for the others
        clock.advance(0.25)
        timer.buckets.gradient_ready()
        clock.advance(0.25)
        timer.buckets.gradient_ready()
        clock.advance(1.0)
    assert timer.exposed_seconds() == pytest.approx(1.0, abs=TOL)
    with timer.phase("optimizer"):  # later phases do not move the backward pass's end
        clock.advance(0.5)
    assert timer.split_backward() == []
    record = timer.end_step(8)
    assert record is not None
    assert record.phases == pytest.approx({"backward": 0.5, "comm_wait": 1.0, "optimizer": 0.5}, abs=TOL)
    assert timer.buckets.last_gradient is None  # taken with the spans


def test_a_step_without_gradient_times_moves_nothing() -> None:  # no_sync steps and one-process runs
    clock = FakeClock(0.0)
    timer = StepTimer(clock=clock)
    record = timed_step(timer, clock, 1, [("forward", 0.25), ("backward", 0.5)])
    assert record is not None and record.phases == pytest.approx({"forward": 0.25, "backward": 0.5}, abs=TOL)


def test_bucket_clock_gradient_times_and_bucket_spans() -> None:
    clock = FakeClock(0.0)
    buckets = BucketClock(clock)
    assert buckets.exposed_seconds(backward_end=5.0) == 0.0  # no gradient yet
    clock.advance(1.0)
    buckets.gradient_ready()
    assert buckets.exposed_seconds() == 0.0  # no end of backward to measure to
    assert buckets.exposed_seconds(backward_end=1.75) == pytest.approx(0.75, abs=TOL)
    assert buckets.exposed_seconds(backward_end=0.5) == 0.0  # never negative
    slot = buckets.bucket_ready(0)
    assert buckets.exposed_seconds(backward_end=1.75) == 0.0  # with the comm hook, only finished buckets count
    clock.advance(0.5)
    buckets.bucket_done(slot)
    assert buckets.exposed_seconds(backward_end=9.0) == pytest.approx(0.5, abs=TOL)


def test_bucket_clock_exposed_seconds() -> None:
    clock = FakeClock(0.0)
    buckets = BucketClock(clock)
    assert buckets.exposed_seconds() == 0.0
    a = buckets.bucket_ready(3)
    clock.advance(1.0)
    b = buckets.bucket_ready(4)  # last ready at 1.0
    assert buckets.exposed_seconds() == 0.0  # nothing finished yet
    clock.advance(0.5)
    buckets.bucket_done(b)  # 1.5
    clock.advance(0.75)
    buckets.bucket_done(a)  # 2.25: the latest finish counts, whichever bucket it is
    assert buckets.exposed_seconds() == pytest.approx(2.25 - 1.0, abs=TOL)
    assert buckets.take() == [(3, 0.0, 2.25), (4, 1.0, 1.5)]
    assert buckets.exposed_seconds() == 0.0 and buckets.take() == []


def test_a_disabled_timer_records_nothing_but_still_tracks_the_activity() -> None:
    clock = FakeClock(0.0)
    spans: list[tuple[str, float, float, int]] = []
    timer = StepTimer(enabled=False, clock=clock, on_span=lambda *span: spans.append(span))
    timer.begin_step(5)
    with timer.phase("forward"):
        assert (timer.activity.step, timer.activity.phase, timer.activity.position) == (5, "forward", (5, 1))
        clock.advance(1.0)
    with timer.phase("backward"):
        timer.buckets.bucket_done(timer.buckets.bucket_ready(0))
        clock.advance(1.0)
    assert timer.split_backward() == [(0, 1.0, 1.0)]
    assert timer.end_step(16) is None
    assert not timer.records and spans == []
    assert timer.activity.phase == "between steps" and timer.activity.position == (5, len(PHASES))


def test_spans_go_to_the_sink_and_synchronize_runs_inside_the_phase() -> None:
    clock = FakeClock(0.0)
    spans: list[tuple[str, float, float, int]] = []
    timer = StepTimer(clock=clock, on_span=lambda *span: spans.append(span),
                      synchronize=lambda: clock.advance(0.125))  # a device sync that takes 0.125 s
    record = timed_step(timer, clock, 7, [("forward", 0.25), ("backward", 0.5)])
    assert spans == [("forward", 0.0, 0.375, 7), ("backward", 0.375, 1.0, 7)]
    assert record is not None and record.phases == pytest.approx({"forward": 0.375, "backward": 0.625}, abs=TOL)


def _record(step: int, seconds: float, records: int, **phases: float) -> StepRecord:
    return StepRecord(step=step, start=float(step), seconds=seconds, phases=phases, records=records)


def test_phase_means_and_rank_profile_by_hand() -> None:
    records = [_record(1, 9.0, 10, data=5.0, forward=3.0),  # a warm-up step, left out below
               _record(2, 1.0, 32, data=0.1, forward=0.2, backward=0.4, optimizer=0.1),
               _record(3, 1.5, 32, data=0.3, forward=0.2, backward=0.6, comm_wait=0.2, optimizer=0.1)]
    means = phase_means(records[1:])
    assert set(means) == {*PHASES, "step"}
    expected = {"data": 0.2, "forward": 0.2, "backward": 0.5, "comm_wait": 0.1, "all_gather": 0.0,
                "reduce_scatter": 0.0, "bubble": 0.0, "optimizer": 0.1, "report": 0.0, "validation": 0.0,
                "checkpoint": 0.0, "step": 1.25}
    assert means == pytest.approx(expected, abs=TOL)
    assert phase_means([]) == {}

    profile = rank_profile(records, skip_first=1)
    assert profile["steps"] == 2 and profile["phase_seconds"] == pytest.approx(expected, abs=TOL)
    assert profile["samples_per_second"] == pytest.approx(32 / 1.25, rel=1e-12)
    assert profile["compute_samples_per_second"] == pytest.approx(32 / (0.2 + 0.2 + 0.5 + 0.1), rel=1e-12)
    everything = rank_profile(records, skip_first=3)  # nothing would be left: all steps count instead
    assert everything["steps"] == 3 and everything["phase_seconds"]["step"] == pytest.approx(11.5 / 3, abs=TOL)
    assert rank_profile([]) == {"steps": 0}


# ------------------------------------------------------------------------------------------ Profiler


def fake_profiler(tmp_path: Path, settings: Profiling | None = None, rank: int = 0) -> tuple[Profiler, FakeClock]:
    clock = FakeClock(0.0)
    profiler = Profiler(settings or Profiling(), rank=rank, run_dir=tmp_path)
    profiler.timer.clock = clock
    profiler.timer.buckets.clock = clock
    return profiler, clock


def profiled_step(profiler: Profiler, clock: FakeClock, step: int, phases: dict[str, float], gap: float,
                  records: int) -> None:
    with profiler.step(step, records=records):
        for name, seconds in phases.items():
            with profiler.phase(name):
                clock.advance(seconds)
        clock.advance(gap)


def test_run_profile_leaves_out_the_warm_up_steps(tmp_path: Path) -> None:
    profiler, clock = fake_profiler(tmp_path)
    steps = [  # (phases, untimed gap, records)
        ({"data": 4.0, "forward": 4.0}, 1.0, 8),  # warm-up
        ({"data": 2.0, "forward": 3.0}, 1.0, 8),  # warm-up
        ({"data": 0.25, "forward": 0.5, "backward": 1.0, "optimizer": 0.25}, 0.0, 32),
        ({"data": 0.75, "forward": 0.5, "backward": 1.0, "optimizer": 0.25}, 0.25, 32),
        ({"data": 0.5, "forward": 0.5, "backward": 2.0, "optimizer": 0.25, "checkpoint": 1.0}, 0.25, 16),
    ]
    for step, (phases, gap, records) in enumerate(steps, start=1):
        profiled_step(profiler, clock, step, phases, gap, records)
    assert WARMUP_STEPS == 2
    kept = steps[WARMUP_STEPS:]
    walls = [sum(phases.values()) + gap for phases, gap, _ in kept]  # 2.0, 2.75, 4.5
    profile = profiler.run_profile()
    assert profile["rank"] == 0 and profile["steps"] == 3
    assert profile["records_per_step"] == pytest.approx(80 / 3, rel=1e-12)
    for name in PHASES:
        times = [phases.get(name, 0.0) for phases, _, _ in kept]
        assert profile["mean_seconds"][name] == pytest.approx(sum(times) / 3, abs=TOL), name
        assert profile["median_seconds"][name] == pytest.approx(statistics.median(times), abs=TOL), name
    assert walls == pytest.approx([2.0, 2.75, 4.5], abs=TOL)
    assert profile["mean_seconds"]["step"] == pytest.approx(9.25 / 3, abs=TOL)
    assert profile["median_seconds"]["step"] == pytest.approx(2.75, abs=TOL)
    assert profile["untimed_share"] == pytest.approx(0.5 / 9.25, rel=1e-9)  # 0.5 s of gaps over 9.25 s of steps
    assert profile["samples_per_second"] == pytest.approx(80 / sum(walls), rel=1e-12)
    compute = sum(phases[name] for phases, _, _ in kept for name in ("data", "forward", "backward", "optimizer"))
    assert profile["compute_samples_per_second"] == pytest.approx(80 / compute, rel=1e-12)


def test_window_profile_covers_the_steps_since_the_last_call(tmp_path: Path) -> None:
    profiler, clock = fake_profiler(tmp_path)
    profiled_step(profiler, clock, 1, {"forward": 1.0}, 0.0, 10)
    profiled_step(profiler, clock, 2, {"forward": 0.5}, 0.5, 20)
    window = profiler.window_profile()
    assert window["forward"] == pytest.approx(0.75, abs=TOL) and window["step"] == pytest.approx(1.0, abs=TOL)
    assert window["records"] == pytest.approx(15.0)
    assert profiler.window_profile() == {}
    profiled_step(profiler, clock, 3, {"data": 0.25}, 0.0, 4)
    assert profiler.window_profile()["data"] == pytest.approx(0.25, abs=TOL)
    # before any step is past the warm-up, the run profile falls back on the last window's steps
    assert profiler.run_profile()["steps"] == 1


def test_a_profiler_with_timers_off_reports_no_steps(tmp_path: Path) -> None:
    profiler, clock = fake_profiler(tmp_path, Profiling(phase_timers=False))
    assert not profiler.enabled
    for step in range(1, 5):
        profiled_step(profiler, clock, step, {"forward": 1.0}, 0.0, 8)
    assert profiler.run_profile() == {"rank": 0, "steps": 0}
    assert profiler.window_profile() == {} and profiler.close() == []


def test_tensorboard_scalars_are_per_rank_milliseconds() -> None:
    rank0 = {"data": 0.002, "forward": 0.0125, "step": 0.05, "records": 32.0}
    scalars = tensorboard_scalars([rank0, {}, {"backward": 0.1, "step": 0.0}])
    for name in (*PHASES, "step"):
        assert scalars[f"profile/{name}_ms/rank0"] == pytest.approx(rank0.get(name, 0.0) * 1e3, rel=1e-12)
        assert f"profile/{name}_ms/rank1" not in scalars  # a rank without steps has no tags
    assert scalars["profile/backward_ms/rank2"] == pytest.approx(100.0)
    assert scalars["throughput/samples_per_second/rank0"] == pytest.approx(32 / 0.05)
    assert "throughput/samples_per_second/rank2" not in scalars  # no wall time: no throughput
    assert len(scalars) == 2 * (len(PHASES) + 1) + 1


# ------------------------------------------------------------------------------ the device's clock (GPU)


class FakeDeviceClock:
    """A GPU's clock as the timers see it: each mark holds the device time at which the fake device passes it,
    the device has passed the marks up to `passed`, and `synchronize` and reads are counted (a read of a mark the
    device has not passed would wait for the device)."""

    def __init__(self) -> None:
        self.device_now = 0.0  # the device time of the next mark
        self.marks: list[float] = []
        self.passed = 0
        self.synchronized = 0
        self.waited = 0
        self.released: list[int] = []

    def mark(self) -> int:
        self.marks.append(self.device_now)
        return len(self.marks) - 1

    def done(self, mark: int) -> bool:
        return mark < self.passed

    def seconds(self, start: int, end: int) -> float:
        if end >= self.passed:
            self.waited += 1
        return self.marks[end] - self.marks[start]

    def release(self, mark: int) -> None:
        self.released.append(mark)

    def synchronize(self) -> None:
        self.synchronized += 1


def device_step(profiler: Profiler, clock: FakeClock, device: FakeDeviceClock, step: int,
                phases: list[tuple[str, float, float]]) -> StepRecord:
    """One step whose phases take (host seconds, device seconds) each."""
    with profiler.step(step, records=8):
        for name, host, on_device in phases:
            with profiler.phase(name):
                clock.advance(host)
                device.device_now += on_device
    return profiler.timer.records[-1]


def test_on_a_gpu_no_phase_waits_for_the_device_and_its_times_are_read_a_step_later(tmp_path: Path) -> None:
    """By default (sync_timings off) the timers never synchronize; a step's phases hold the device's times once a
    later step has started and the device is past the step's marks, and not one read of a mark waits."""
    device = FakeDeviceClock()
    profiler = Profiler(Profiling(), rank=0, run_dir=tmp_path, device_clock=device)
    clock = FakeClock(0.0)
    profiler.timer.clock = clock
    first = device_step(profiler, clock, device, 1, [("data", 0.01, 0.5), ("forward", 0.02, 2.0),
                                                     ("backward", 0.03, 4.0)])
    assert device.synchronized == 0
    assert first.phases == pytest.approx({"data": 0.01, "forward": 0.02, "backward": 0.03}, abs=TOL)  # host times
    device.passed = len(device.marks)  # the device has done step 1's work
    second = device_step(profiler, clock, device, 2, [("data", 0.01, 0.25), ("forward", 0.02, 1.0)])
    assert first.phases == pytest.approx({"data": 0.5, "forward": 2.0, "backward": 4.0}, abs=TOL)
    assert second.phases == pytest.approx({"data": 0.01, "forward": 0.02}, abs=TOL)  # not passed yet: not read
    assert device.waited == 0 and device.synchronized == 0
    assert sorted(device.released) == list(range(6))  # step 1's events go back to the pool
    profile = profiler.window_profile()  # a report reads every step's figures: it may wait for the device
    assert second.phases == pytest.approx({"data": 0.25, "forward": 1.0}, abs=TOL)
    assert profile["forward"] == pytest.approx(1.5, abs=TOL) and device.waited == 2


def test_sync_timings_waits_for_the_device_at_every_phase_end(tmp_path: Path) -> None:
    device = FakeDeviceClock()
    profiler = Profiler(Profiling(sync_timings=True), rank=0, run_dir=tmp_path, device_clock=device)
    device_step(profiler, FakeClock(0.0), device, 1, [("data", 0.01, 0.5), ("forward", 0.02, 2.0)])
    assert device.synchronized == 2 and device.marks == []


def test_device_times_keep_the_moves_between_phases() -> None:
    """A wait carved out of a phase, and the exposed communication cut from backward, move the same seconds out of
    the device's times as out of the host's (never more than the phase holds)."""
    clock, device = FakeClock(0.0), FakeDeviceClock()
    timer = StepTimer(clock=clock, device_clock=device)
    timer.begin_step(1)
    with timer.phase("forward"):
        clock.advance(0.5)
        device.device_now += 3.0
        timer.carve("all_gather", 0.25)
    timer.buckets.last_gradient = clock() + 0.75
    with timer.phase("backward"):
        clock.advance(1.0)
        device.device_now += 0.125
    timer.split_backward()
    record = timer.end_step(8)
    assert record is not None
    assert record.phases == pytest.approx({"forward": 0.25, "all_gather": 0.25, "backward": 0.75,
                                           "comm_wait": 0.25}, abs=TOL)
    device.passed = len(device.marks)
    timer.settle(wait=False)
    assert record.phases == pytest.approx({"forward": 2.75, "all_gather": 0.25, "backward": 0.0,
                                           "comm_wait": 0.125}, abs=TOL)


def test_a_device_far_behind_is_waited_for_beyond_max_pending() -> None:
    clock, device = FakeClock(0.0), FakeDeviceClock()
    timer = StepTimer(clock=clock, device_clock=device, max_pending=2)
    for step in range(1, 5):
        timed_step(timer, clock, step, [("forward", 0.5)])
    assert device.waited == 2 and len(timer._pending) == 2
