"""The glibc malloc settings `dtrain run` gives its workers (optimizations.malloc_trim_threshold_mb)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtrain import launch
from dtrain.config import load_config

MINIMAL = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8}, "searcher": {"max_length": {"batches": 1}}}


def _expected(trim_mb: int) -> dict[str, str]:
    """The variables written out by hand: trim threshold in bytes, the mmap threshold fixed at 32 MiB."""
    return {"MALLOC_TRIM_THRESHOLD_": str(trim_mb * 1024 * 1024), "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024)}


def test_default_config_keeps_256_mb_and_fixes_the_mmap_threshold() -> None:
    trim = load_config(None, raw=MINIMAL).config.optimizations
    assert trim.malloc_trim_threshold_mb == 256
    assert launch.malloc_environment(256, user_settings={}) == _expected(256)


def test_null_or_a_users_own_malloc_variable_leaves_glibc_alone() -> None:
    assert launch.malloc_environment(None, user_settings={}) == {}
    assert launch.malloc_environment(256, user_settings={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {}


def test_worker_environment_replaces_what_a_previous_run_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_USER_MALLOC_SETTINGS", {})
    for name in ("DTRAIN_LAUNCHER", "OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    launch._worker_environment(2, malloc_trim_threshold_mb=64)
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == str(64 << 20)
    launch._worker_environment(2, malloc_trim_threshold_mb=None)  # the next trial of a search turns it off
    assert "MALLOC_TRIM_THRESHOLD_" not in os.environ and "MALLOC_MMAP_THRESHOLD_" not in os.environ


def test_a_users_variable_survives_the_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_USER_MALLOC_SETTINGS", {"MALLOC_TRIM_THRESHOLD_": "1000"})
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    launch._worker_environment(2, malloc_trim_threshold_mb=256)
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "1000" and "MALLOC_MMAP_THRESHOLD_" not in os.environ


def test_a_negative_threshold_is_refused_with_the_key_named() -> None:
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="malloc_trim_threshold_mb"):
        load_config(None, raw={**MINIMAL, "optimizations": {"malloc_trim_threshold_mb": -1}})


def test_calibration_processes_get_the_workers_malloc_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.calibrate.calibrate import _worker_malloc_environment

    monkeypatch.setattr(launch, "_USER_MALLOC_SETTINGS", {})
    digits = Path(__file__).resolve().parents[1] / "fixtures" / "digits.yaml"
    assert _worker_malloc_environment(None, ()) == _expected(256)
    assert _worker_malloc_environment(digits, ["optimizations.malloc_trim_threshold_mb=64"]) == _expected(64)
    assert _worker_malloc_environment(digits, ["optimizations.malloc_trim_threshold_mb=null"]) == {}


def test_horovodrun_processes_get_the_same_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.horovod.launcher import HorovodRun, environment

    monkeypatch.setattr(launch, "_USER_MALLOC_SETTINGS", {})
    env = environment(HorovodRun(command=["true"]), tmp_path)
    assert {name: env.get(name) for name in _expected(256)} == _expected(256)
    monkeypatch.setattr(launch, "_USER_MALLOC_SETTINGS", {"MALLOC_TOP_PAD_": "0"})
    assert "MALLOC_TRIM_THRESHOLD_" not in environment(HorovodRun(command=["true"]), tmp_path)
