"""What `dtrain run` says when a worker dies: a rank killed by a signal is named with the last line its log holds
(a native crash leaves its reason nowhere else), a rank that raised is named with its own error."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, ProcessFailure

from dtrain.launch import _describe_failure, last_log_line


def _run_dir(tmp_path: Path, logs: dict[int, str]) -> Path:
    (tmp_path / "logs").mkdir()
    for rank, text in logs.items():
        (tmp_path / "logs" / f"rank-{rank}.log").write_text(text)
    return tmp_path


def test_a_rank_killed_by_a_signal_is_named_with_the_last_line_of_its_log(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, {1: "step 3\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                                     "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes\n\n"})
    aborted = ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGABRT, error_file=str(tmp_path / "none.json"))
    message = _describe_failure(ChildFailedError("dtrain.worker", {1: aborted}), run_dir)
    assert message.startswith("rank 1 killed by SIGABRT after: what():  [enforce fail at pair.cc:446]"), message
    assert message.endswith(f"(log: {run_dir / 'logs' / 'rank-1.log'})")


def test_a_killed_rank_without_a_log_is_named_with_its_signal_only(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, {})
    killed = ProcessFailure(local_rank=0, pid=1, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    message = _describe_failure(ChildFailedError("dtrain.worker", {0: killed}), run_dir)
    assert message == f"rank 0 killed by SIGKILL (log: {run_dir / 'logs' / 'rank-0.log'})"


def test_the_last_log_line_skips_blank_lines_and_is_cut_to_the_limit(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("first\n" + "x" * 500 + "\n   \n")
    assert last_log_line(log, limit=40) == "x" * 40
    assert last_log_line(tmp_path / "missing.log") == ""
    log.write_bytes(b"y" * 20000 + b"\nlast \xff line\n")  # longer than the tail read, not UTF-8
    assert last_log_line(log) == "last \ufffd line"


def test_a_rank_that_raised_is_named_with_its_own_error_not_its_log(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _run_dir(tmp_path, {0: "step 3\nsome unrelated last line\n"})
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("the worker's own error")
    except RuntimeError as exc:
        ErrorHandler().record_exception(exc)  # what @record does in the worker
    failed = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    message = _describe_failure(ChildFailedError("dtrain.worker", {0: failed}), run_dir)
    assert message.startswith("rank 0 exit code 1: "), message
    assert "the worker's own error" in message and "unrelated" not in message
