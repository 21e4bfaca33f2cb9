"""An exception in user code ends the run when the attempt before met the same one (runs/repeats.py), and the
launcher's agent stops restarting on a user error (launch.py's StopOnUserError)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from dtrain.launch import _stop_on_user_error_class, is_user_error
from dtrain.runs.fatal import FATAL_FILE, write_fatal
from dtrain.runs.repeats import describe_exception, is_user_file, record_exception, recorded

USER_CODE = '''import json


def train_batch(text):
    return json.loads(text)["loss"]
'''


def _user_module(tmp_path: Path) -> ModuleType:
    path = tmp_path / "my_trial.py"
    path.write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location("my_trial", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raised(tmp_path: Path, text: str, *, attempt: int = 0, batches_done: int | None = 2, rank: int = 0) -> Any:
    module = _user_module(tmp_path)
    try:
        module.train_batch(text)
    except Exception as exc:  # noqa: BLE001 - whatever the user's code raises
        return describe_exception(exc, rank=rank, attempt=attempt, batches_done=batches_done)
    raise AssertionError("the user's code did not raise")


def test_the_place_is_the_innermost_user_frame_and_the_traceback_shows_only_the_users(tmp_path: Path) -> None:
    found = _raised(tmp_path, "{not json")  # raised inside the json module, called from line 5 of the user's file
    assert found.kind == "JSONDecodeError" and found.user_code
    assert found.where == f"{tmp_path / 'my_trial.py'}:5" and found.function == "train_batch"
    assert found.describe() == (f"JSONDecodeError: {found.message} in train_batch (my_trial.py:5) after 2 batches")
    lines = found.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last; the user's frames only):"
    assert not [line for line in lines if "json/decoder.py" in line or "/dtrain/" in line]
    assert lines[-1].startswith("json.decoder.JSONDecodeError: Expecting property name")
    assert is_user_file(str(tmp_path / "my_trial.py")) and not is_user_file(json.__file__)
    assert not is_user_file("<frozen runpy>") and not is_user_file(str(Path(describe_exception.__code__.co_filename)))


def test_an_error_without_a_user_frame_is_marked_so(tmp_path: Path) -> None:
    try:
        json.loads("{")
    except ValueError as exc:
        found = describe_exception(exc, rank=0, attempt=0, batches_done=None, libraries=(os.path.dirname(__file__),
                                                                                          os.path.dirname(json.__file__)))
    assert not found.user_code and found.traceback.startswith("Traceback (most recent call last):")
    assert found.describe().endswith("before training")


def test_the_same_exception_in_the_attempt_right_before_is_a_repeat(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _raised(tmp_path, "{not json", attempt=0, rank=1)
    assert record_exception(run_dir, first) is None  # nothing before it: restart
    again = replace(first, attempt=1, rank=0)  # the next attempt, another rank: the same place and batch
    assert record_exception(run_dir, again) == first
    assert [e.rank for e in recorded(run_dir, first.launch, 1)] == [0]
    assert [e.rank for e in recorded(run_dir, first.launch, 0)] == [1]


@pytest.mark.parametrize("change", [
    {"batches_done": 3},  # a later batch: the restart got further
    {"where": "elsewhere.py:9"},  # another place
    {"kind": "KeyError"},  # another exception
    {"attempt": 2},  # not the attempt right after (one in between failed otherwise)
    {"launch": "another-launch"},  # an earlier launch of the same run dir
    {"user_code": False},  # no user frame: a crash seen through torch is left to the restarts
])
def test_anything_else_is_not_a_repeat(change: dict[str, object], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _raised(tmp_path, "{not json", attempt=0)
    record_exception(run_dir, first)
    assert record_exception(run_dir, replace(first, **{"attempt": 1, **change})) is None  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- the agent's decision


class _FakeAgent:
    """What StopOnUserError uses of torch's agent: _monitor_workers and _remaining_restarts."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        self._remaining_restarts = 3

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        return self.result


def _watch(run_dir: Path, exit_codes: list[int], *, run_id: str = "launch-1") -> Any:
    failures = {rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(exit_codes)}
    agent = _stop_on_user_error_class(_FakeAgent, run_dir, run_id)(RunResult(WorkerState.FAILED, failures=failures))
    agent._monitor_workers(SimpleNamespace(spec=SimpleNamespace(max_restarts=3)))
    return agent


@pytest.mark.parametrize("codes", [[2, 1], [1, 4], [-9, 2]])
def test_a_user_error_exit_code_leaves_no_restarts(codes: list[int], tmp_path: Path) -> None:
    assert _watch(tmp_path, codes)._remaining_restarts == 0


@pytest.mark.parametrize("codes", [[1, 1], [-9, 1], [1, -15]])
def test_a_crash_or_a_lost_peer_keeps_the_restarts(codes: list[int], tmp_path: Path) -> None:
    assert _watch(tmp_path, codes)._remaining_restarts == 3


def test_a_fatal_error_file_of_this_launch_leaves_no_restarts(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-0")
    write_fatal(tmp_path, "an earlier launch's error", rank=0)
    assert _watch(tmp_path, [1, 1])._remaining_restarts == 3  # another launch's record never stops this one
    (tmp_path / FATAL_FILE).unlink()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    write_fatal(tmp_path, "the Trial's error", rank=1)
    assert is_user_error(tmp_path, "launch-1", [1])
    assert _watch(tmp_path, [1, 1])._remaining_restarts == 0


def test_a_restart_after_an_exception_in_user_code_says_which(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    found = _raised(tmp_path, "{not json", attempt=0)
    record_exception(tmp_path, found)
    record_exception(tmp_path, replace(found, rank=1))  # the same on another rank: said once
    assert _watch(tmp_path, [1, 1])._remaining_restarts == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("dtrain: rank 0: JSONDecodeError: ") and "in train_batch (my_trial.py:5) after 2 batches; " \
        "restarting" in line, line
    assert line.endswith(f"restarting the workers from the latest checkpoint (restart 1 of 3; traceback in "
                         f"{tmp_path / 'logs' / 'rank-0.log'})")
