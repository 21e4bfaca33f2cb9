"""The fusion tuner's candidates and its choice, fed with known step times."""

from __future__ import annotations

import pytest

from dtrain.sync.fusion import FusionTuner, candidate_bucket_sizes


def test_candidates_span_one_bucket_to_many() -> None:
    sizes = candidate_bucket_sizes(model_mb=9.6, configured_mb=25.0)
    assert sizes[0] == pytest.approx(9.6 * 1.01, rel=1e-3)  # 25 MB is one bucket, like the whole model
    assert sizes == [sizes[0], pytest.approx(2.4), pytest.approx(0.6)]
    assert candidate_bucket_sizes(model_mb=1.6, configured_mb=25.0) == [pytest.approx(1.616), pytest.approx(0.4)]
    assert candidate_bucket_sizes(model_mb=0.1, configured_mb=25.0) == [pytest.approx(0.101)]  # nothing to tune
    assert candidate_bucket_sizes(model_mb=100.0, configured_mb=25.0)[:2] == [25.0, 101.0]


def drive(tuner: FusionTuner, seconds_of: dict[float, list[float]]) -> list[float]:
    """Run the tuner to the end with per-candidate step times (cycled); return the sizes it trained with."""
    used, counters = [], {size: 0 for size in seconds_of}
    while not tuner.done:
        size = tuner.current
        used.append(size)
        times = seconds_of[size]
        tuner.observe(times[counters[size] % len(times)])
        counters[size] += 1
        if tuner.visit_complete():
            tuner.finish_visit(tuner.local_median())
    return used


def test_tuner_visits_every_candidate_in_alternating_rounds_and_keeps_the_fastest() -> None:
    tuner = FusionTuner([25.0, 4.0, 1.0], steps_per_visit=3, rounds=2, warmup_steps=0)
    used = drive(tuner, {25.0: [9.0, 0.30, 0.31], 4.0: [9.0, 0.20, 0.21], 1.0: [9.0, 0.25, 0.26]})
    assert used == [25.0] * 3 + [4.0] * 3 + [1.0] * 3 + [1.0] * 3 + [4.0] * 3 + [25.0] * 3
    assert tuner.best == 4.0 and tuner.current == 4.0
    assert tuner.visit_times()[4.0] == pytest.approx(0.205)
    assert "bucket size 4 MB chosen" in tuner.report()
    assert "4 MB 205.00 ms" in tuner.report()


def test_first_step_of_a_visit_is_not_timed() -> None:
    tuner = FusionTuner([2.0, 8.0], steps_per_visit=2, rounds=1, warmup_steps=0)
    drive(tuner, {2.0: [100.0, 1.0], 8.0: [0.0, 2.0]})
    assert tuner.best == 2.0


def test_warm_up_steps_are_not_timed_and_one_disturbed_visit_cannot_decide() -> None:
    tuner = FusionTuner([2.0, 8.0], steps_per_visit=2, rounds=3, warmup_steps=3)
    # 3 warm-up steps, then visits 2, 8, 8, 2, 2, 8 of 2 steps each (the first untimed); the first visit of
    # 2 MB is disturbed (9 s): its mean would lose to 8 MB, its median wins
    times = [50.0] * 3 + [0, 9.0] + [0, 2.0] * 2 + [0, 1.0] * 2 + [0, 2.0]
    used = []
    for seconds in times:
        used.append(tuner.current)
        tuner.observe(seconds)
        if tuner.visit_complete():
            tuner.finish_visit(tuner.local_median())
    assert tuner.done
    assert used == [2.0] * 5 + [8.0] * 4 + [2.0] * 4 + [8.0] * 2
    assert tuner.visits[0] == (2.0, 9.0)
    assert tuner.best == 2.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        FusionTuner([], steps_per_visit=3)
    with pytest.raises(ValueError):
        FusionTuner([1.0], steps_per_visit=1)
