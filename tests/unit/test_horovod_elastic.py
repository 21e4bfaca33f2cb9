"""Horovod Elastic's pieces without processes: the sizes `--min-np/-np/--max-np` allow, the host discovery
script's output, and the one-line errors for what cannot work (checked before any worker starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.errors import LaunchError
from dtrain.horovod.elastic_driver import ElasticLimits, check_limits, local_slots
from dtrain.horovod.launcher import discover_hosts
from dtrain.horovod.membership import is_collective_failure


def _script(tmp_path: Path, body: str, executable: bool = True) -> str:
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755 if executable else 0o644)
    return str(path)


def test_the_job_starts_at_np_within_the_slots_and_the_limits() -> None:
    assert check_limits(3, 2, 3, 3, None) == ElasticLimits(initial=3, min_np=2, max_np=3, reset_limit=None)
    assert check_limits(None, 2, 4, 3, 5) == ElasticLimits(initial=3, min_np=2, max_np=4, reset_limit=5)
    assert check_limits(2, 2, 4, 8, None).initial == 2  # -np is where it starts; it grows at commits later
    assert check_limits(None, None, 3, 2, None) == ElasticLimits(initial=2, min_np=1, max_np=3, reset_limit=None)


@pytest.mark.parametrize(("np", "min_np", "max_np", "slots", "message"), [
    (None, 3, 2, 4, "--min-np 3 is above --max-np 2"),
    (None, 0, 2, 4, "--min-np 0: at least 1"),
    (4, 2, 3, 4, "-np 4 is outside --min-np 2 .. --max-np 3"),
    (None, 3, 4, 2, "only 2 slot\\(s\\) available, fewer than --min-np 3"),
])
def test_sizes_that_cannot_work_are_one_line(np: int | None, min_np: int, max_np: int, slots: int,
                                             message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        check_limits(np, min_np, max_np, slots, None)


def test_discovery_output_is_host_slots_lines(tmp_path: Path) -> None:
    assert discover_hosts(_script(tmp_path, "echo localhost:2; echo '# spare'; echo; echo 127.0.0.1:1")) == [
        ("localhost", 2), ("127.0.0.1", 1)]
    assert discover_hosts(_script(tmp_path, "echo localhost")) == [("localhost", 1)]


@pytest.mark.parametrize(("body", "message"), [
    ("echo 'hello world'", "printed 'hello world': each line must be host:slots"),
    ("echo localhost:two", "printed 'localhost:two'"),
    ("echo localhost:0", "printed 'localhost:0'"),
    ("true", "printed no hosts"),
    ("exit 3", "failed: Command .* returned non-zero exit status 3"),
])
def test_discovery_scripts_that_print_nonsense_are_one_line(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        discover_hosts(_script(tmp_path, body))


def test_a_missing_or_unexecutable_discovery_script_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no such file"):
        discover_hosts(str(tmp_path / "absent.sh"))
    with pytest.raises(LaunchError, match="is not executable: chmod \\+x"):
        discover_hosts(_script(tmp_path, "echo localhost:2", executable=False))


def test_elastic_jobs_run_on_this_host_only() -> None:
    assert local_slots([("localhost", 2), ("127.0.0.1", 1)], "-H") == 3
    with pytest.raises(LaunchError, match="names 'node-b', not this machine"):
        local_slots([("localhost", 2), ("node-b", 2)], "-H")


def test_bad_elastic_flags_answer_one_line_before_any_worker(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in [
        (["--min-np", "3", "--max-np", "2"], "--min-np 3 is above --max-np 2"),
        (["--min-np", "2", "--max-np", "3", "--host-discovery-script", str(tmp_path / "absent.sh")], "no such file"),
        (["--min-np", "2", "--max-np", "3", "--host-discovery-script", _script(tmp_path, "echo nonsense here")],
         "printed 'nonsense here'"),
    ]:
        code = main(["horovodrun", *args, "python", "-c", "pass"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_only_broken_connections_count_as_a_lost_peer() -> None:
    assert is_collective_failure(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x6 and 5x2)"))
    assert not is_collective_failure(ValueError("Connection reset"))


def test_a_worker_joins_the_newest_generation_that_lists_it_and_leaves_when_left_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's side of the driver's announcements, in this process (a job of one): the rank table of the
    newest generation gives rank and size; a generation without this worker removes it."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from dtrain.horovod import membership

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv(membership.STORE_VAR, f"127.0.0.1:{store.port}")
    monkeypatch.setenv(membership.WORKER_VAR, "w7")
    monkeypatch.setenv(membership.TIMEOUT_VAR, "20")
    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)  # join sets them; restored after the test
    monkeypatch.setattr(membership, "_STORE", [])
    monkeypatch.setattr(membership, "CURRENT", [])
    assert membership.latest_generation() == -1
    store.set("gen/0/ranks", json.dumps({"w3": 0}))
    store.set("gen/1/ranks", json.dumps({"w7": 0}))
    store.set(membership.GENERATION_KEY, "1")
    try:
        joined = membership.join(after=-1, collective_timeout=20)
        assert (joined.generation, joined.rank, joined.size) == (1, 0, 1)
        assert membership.current_generation() == 1 and dist.get_world_size() == 1
        assert store.get("joined/w7") == b"1"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    store.set("gen/2/ranks", json.dumps({"w3": 0}))
    store.set(membership.GENERATION_KEY, "2")
    with pytest.raises(membership.RemovedFromJob, match="w7 is not in generation 2"):
        membership.join(after=1, collective_timeout=20)
