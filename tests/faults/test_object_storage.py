"""Checkpoints in object storage, against a real S3-compatible server (moto's, on loopback; s3kit.py): runs
SIGKILLed in the middle of a checkpoint upload and between checkpoints resume from the last complete checkpoint and
end bitwise identical to an uninterrupted local run (DDP and FSDP's sharded checkpoints); keep-latest/keep-best
deletion leaves exactly what it promises in the bucket; `dtrain export s3://...` writes a plain model.pt; secrets
never reach a file of the run; bad storage is one line before any worker starts."""

from __future__ import annotations

import importlib.util
import io
import json
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from faultkit import (
    CONFIG,
    FIXTURES,
    dtrain,
    error_lines,
    fault_records,
    final_model,
    summary,
    uninterrupted_model,
)
from s3kit import KEY, SECRET, client_env, filesystem, free_port, make_bucket, missing_packages, moto_server

from dtrain.train.upload import UPLOAD_THREAD

pytestmark = pytest.mark.skipif(missing_packages() is not None, reason=str(missing_packages()))

BUCKET = "dtrain-ckpts"
# Killed once in the middle of uploading step-20 (model.pt is in the bucket, meta.json is not: the resume must take
# step-10, whose upload step-20's waited for), then once between checkpoints (batch 25: the resume takes step-20
# once it is committed; a background upload of step-20 still in flight at the kill is lost, and the resume takes
# step-10). digits.yaml checkpoints every 10.
KILLS = "[{rank: 0, batch: 20, during: checkpoint}, {rank: 1, batch: 25}]"
RESUMED_FROM = [10, 20]
RUN_TIMEOUT = 600  # two restarts, each starting its workers again, on a shared machine


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        make_bucket(url, BUCKET)
        yield url


def _experiment(tmp_path: Path, endpoint: str, **storage: Any) -> Path:
    """digits.yaml with its checkpoints in the bucket, credentials in the file (as Determined's files hold them)."""
    raw = yaml.safe_load(CONFIG.read_text())
    raw["entrypoint"] = f"{FIXTURES / 'digits_trial.py'}:DigitsTrial"
    raw["checkpoint_storage"] = {"type": "s3", "bucket": BUCKET, "prefix": "team/runs", "endpoint_url": endpoint,
                                 "access_key": KEY, "secret_key": SECRET, **storage}
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _run_killed(tmp_path: Path, endpoint: str, *settings: str, **storage: Any) -> tuple[Path, str]:
    """A run with KILLS that must complete; its run dir and the URL of its checkpoints."""
    run_dir = tmp_path / "run"
    settings = (f"faults.kills={KILLS}", "max_restarts=3", *settings)
    overrides = [arg for setting in settings for arg in ("--set", setting)]
    no_aws = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}  # the credentials come from the file alone
    result = dtrain("run", _experiment(tmp_path, endpoint, **storage), *overrides, "--run-dir", run_dir,
                    env={"DTRAIN_RUNS_ROOT": str(tmp_path / "runs"), **no_aws}, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    fired = fault_records(run_dir)
    background = storage.get("background_upload", False) and "distributed.strategy=fsdp" not in settings
    kills = [(r["rank"], r["batch"], r["during"]) for r in fired]
    # training goes on during a background upload, so batch 25 may come before the upload of step-20 reaches its
    # kill: then rank 0, failing, waits for its upload, is killed there, and the one resume takes step-10
    assert (sorted(kills) if background else kills) == [(0, 20, "checkpoint"), (1, 25, "step")]
    [in_upload] = [r for r in fired if r["during"] == "checkpoint"]
    assert in_upload["thread"] == (UPLOAD_THREAD if background else "MainThread")
    resumed = _resumed_from_last_commit((run_dir / "logs" / "rank-0.log").read_text())
    assert resumed == RESUMED_FROM or (background and resumed[:1] == [10]), resumed
    url = json.loads((run_dir / "run.json").read_text())["checkpoints"]["url"]
    assert url.startswith(f"s3://{BUCKET}/team/runs/digits_test-")
    assert not (run_dir / "checkpoints").exists()  # the run dir keeps logs, metrics and the summary only
    return run_dir, url


def _resumed_from_last_commit(log: str) -> list[int]:
    """The steps each restart resumed from, checked to be the newest checkpoint committed before it (a kill loses
    at most the upload in flight)."""
    committed, resumed = 0, []
    for line in log.splitlines():
        if "resumed from checkpoint" in line:
            resumed.append(int(line.rsplit("step-", 1)[1]))
            assert resumed[-1] == committed, f"resumed from step-{resumed[-1]}; the last commit was step-{committed}"
        elif " written in " in line and "checkpoint " in line:
            committed = int(line.split("/step-", 1)[1].split()[0])
    return resumed


def _no_secret_in(*roots: Path) -> None:
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert KEY.encode() not in data and SECRET.encode() not in data, f"a secret is in {path}"


def _bucket_steps(endpoint: str, url: str) -> list[str]:
    fs = filesystem(endpoint)
    return sorted(Path(p).name for p in fs.ls(url.removeprefix("s3://"), detail=False) if "/step-" in p)


@pytest.fixture(scope="module")
def clean_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return uninterrupted_model(tmp_path_factory.mktemp("clean"))


@pytest.mark.parametrize("background_upload", [True, False], ids=["background", "blocking"])
def test_s3_run_killed_in_an_upload_and_between_checkpoints_ends_bitwise_identical(
        background_upload: bool, endpoint: str, clean_model: bytes, tmp_path: Path) -> None:
    run_dir, url = _run_killed(tmp_path, endpoint, save_trial_latest=2, background_upload=background_upload)
    fs = filesystem(endpoint)
    found = summary(run_dir)
    assert found["checkpoint"] == f"{url}/step-40/model.pt"
    assert fs.cat(found["checkpoint"].removeprefix("s3://")) == clean_model

    # keep-latest 2 and keep-best 1: the two newest complete checkpoints and the best one, nothing else
    state = torch.load(io.BytesIO(fs.cat(f"{url.removeprefix('s3://')}/step-40/state.pt")), weights_only=True)
    metrics = {int(step): value for step, value in state["trainer"]["checkpoint_metrics"].items()}
    best = max(metrics, key=lambda step: metrics[step])  # digits' searcher metric is accuracy
    assert _bucket_steps(endpoint, url) == sorted({"step-30", "step-40", f"step-{best}"})
    for step in _bucket_steps(endpoint, url):
        assert fs.exists(f"{url.removeprefix('s3://')}/{step}/meta.json")
    assert fs.cat(f"{url.removeprefix('s3://')}/latest").decode().strip() == "step-40"
    _no_secret_in(run_dir, tmp_path / "runs")

    # dtrain export from the bucket's URL: a plain model.pt with the trained weights
    exported = tmp_path / "exported.pt"
    result = dtrain("export", url, "-o", exported, env=client_env(endpoint))
    assert result.returncode == 0, result.stderr
    trained = torch.load(io.BytesIO(clean_model), weights_only=True)
    plain = torch.load(exported, weights_only=True)
    assert plain.keys() == trained.keys() and all(torch.equal(plain[k], trained[k]) for k in trained)


def test_fsdp_sharded_checkpoints_in_s3_resume_and_export_bitwise_identical(endpoint: str, tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    result = dtrain("run", CONFIG, "--set", "distributed.strategy=fsdp", "--run-dir", clean,
                    env={"DTRAIN_RUNS_ROOT": str(tmp_path / "clean-runs")}, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir, url = _run_killed(tmp_path, endpoint, "distributed.strategy=fsdp")
    fs = filesystem(endpoint)
    shards = fs.ls(f"{url.removeprefix('s3://')}/sharded", detail=False)
    assert [Path(p).name for p in shards] == ["step-40"]  # pruned with their checkpoints
    assert fs.exists(f"{shards[0]}/.metadata")
    exported = {}
    for name, source, env in (("local", str(clean), None), ("s3", url, client_env(endpoint))):
        exported[name] = tmp_path / f"{name}.pt"
        result = dtrain("export", source, "-o", exported[name], env=env)
        assert result.returncode == 0, result.stderr
    local, remote = (torch.load(exported[name], weights_only=True) for name in ("local", "s3"))
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)


BAD_STORAGE = {"unreachable endpoint": "the endpoint cannot be reached", "wrong credentials": "access denied",
               "missing bucket": "the bucket does not exist", "gcs without gcsfs": "needs the gcsfs package"}


@pytest.mark.parametrize("case", list(BAD_STORAGE))
def test_bad_storage_is_one_line_before_any_worker_starts(case: str, endpoint: str, tmp_path: Path) -> None:
    if case == "gcs without gcsfs" and importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    run_dir, env = tmp_path / "run", {"DTRAIN_RUNS_ROOT": str(tmp_path / "runs")}
    with moto_server(require_auth=True) if case == "wrong credentials" else nullcontext(endpoint) as server:
        config = _experiment(tmp_path, server, **{
            "unreachable endpoint": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
            "missing bucket": {"bucket": "no-such-bucket"}}.get(case, {}))
        if case == "gcs without gcsfs":
            raw = yaml.safe_load(config.read_text())
            raw["checkpoint_storage"] = {"type": "gcs", "bucket": BUCKET}
            config.write_text(yaml.safe_dump(raw))
        result = dtrain("run", config, "--run-dir", run_dir, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = error_lines(result.stderr)
    assert BAD_STORAGE[case] in line, line
    assert "Traceback" not in result.stderr and SECRET not in result.stderr
    assert not run_dir.exists()  # nothing started, nothing written


def _search(tmp_path: Path, name: str, storage: dict[str, Any] | None, *settings: str,
            env: dict[str, str] | None = None) -> Path:
    """The digits search (2 trials, 20 batches, a checkpoint every 10) to its end; its search dir."""
    raw = yaml.safe_load((FIXTURES / "digits_search.yaml").read_text())
    raw["entrypoint"] = f"{FIXTURES / 'digits_trial.py'}:DigitsTrial"
    raw["searcher"]["max_trials"] = 2
    if storage is not None:
        raw["checkpoint_storage"] = storage
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    search_dir = tmp_path / name
    overrides = [arg for setting in settings for arg in ("--set", setting)]
    result = dtrain("run", config, "--slots", "2", "--search-dir", search_dir, *overrides,
                    env={"DTRAIN_RUNS_ROOT": str(tmp_path / f"{name}-runs"), **(env or {})}, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 of 2 trials completed" in result.stdout
    return search_dir


def test_a_search_s_trials_checkpoint_to_s3_and_resume_from_there(endpoint: str, tmp_path: Path) -> None:
    clean = _search(tmp_path, "clean", None)
    storage = {"type": "s3", "bucket": BUCKET, "prefix": "searches", "endpoint_url": endpoint,
               "background_upload": True}
    # every trial is killed once in the background upload of its last checkpoint (step-20) and resumes from step-10
    # in the bucket (whose upload step-20's waited for); the credentials come from the usual AWS environment
    s3 = _search(tmp_path, "s3", storage, "faults.kills=[{rank: 0, batch: 20, during: checkpoint}]", "max_restarts=1",
                 env=client_env(endpoint))
    fs = filesystem(endpoint)
    for number in (0, 1):
        trial = s3 / f"trial-{number}"
        assert "resumed from checkpoint step-10" in (trial / "logs" / "rank-0.log").read_text()
        assert [record["thread"] for record in fault_records(trial)] == [UPLOAD_THREAD]
        assert not (trial / "checkpoints").exists()
        url = summary(trial)["checkpoint"]
        assert url.startswith(f"s3://{BUCKET}/searches/digits_search-") and url.endswith("/step-20/model.pt")
        assert fs.cat(url.removeprefix("s3://")) == final_model(clean / f"trial-{number}")
    results = json.loads((s3 / "results.json").read_text())
    assert all(trial["checkpoint"].startswith(f"s3://{BUCKET}/") for trial in results["trials"])
