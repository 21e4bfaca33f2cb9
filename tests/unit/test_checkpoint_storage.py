"""`checkpoint_storage` as Determined defines it: every key of every type loads, secrets never leave memory, bad
values get one line, and each type's checkpoints go where Determined would put them (a local folder here; the S3
server tests are in tests/faults/test_object_storage.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dtrain.config import dump_config, load_config
from dtrain.errors import CheckpointError, ConfigError
from dtrain.runs.rundir import RUN_FILE, load_run_info, prepare_run_dir
from dtrain.runs.storage import CheckpointStore, base_url, prepare_storage, require_library, store_for_url
from dtrain.train import checkpoint as ckpt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BASE = yaml.safe_load((FIXTURES / "digits.yaml").read_text())

# Every key Determined's schemas give each type (master/pkg/schemas/expconf, storage_config.go and v0/*.json), with
# the counts every type shares.
COUNTS = {"save_experiment_best": 0, "save_trial_best": 2, "save_trial_latest": 3}
EVERY_KEY: dict[str, dict[str, Any]] = {
    "shared_fs": {"type": "shared_fs", "host_path": "/mnt/shared", "storage_path": "dtrain/ckpts",
                  "container_path": "/determined_shared_fs", "propagation": "rprivate",
                  "checkpoint_path": "/mnt/shared/old", "tensorboard_path": "/mnt/shared/tb", **COUNTS},
    "directory": {"type": "directory", "container_path": "/data/checkpoints", **COUNTS},
    "s3": {"type": "s3", "bucket": "team-bucket", "prefix": "runs/dtrain", "endpoint_url": "http://127.0.0.1:9000",
           "access_key": "AKIAUNITTESTKEY", "secret_key": "unit-test-secret", **COUNTS},
    "gcs": {"type": "gcs", "bucket": "team-bucket", "prefix": "runs", **COUNTS},
    "azure": {"type": "azure", "container": "ckpts", "account_url": "https://acct.blob.core.windows.net",
              "credential": "unit-test-azure-key", "prefix": "runs", **COUNTS},
    "azure_connection": {"type": "azure", "container": "ckpts", "prefix": "runs",
                         "connection_string": "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=unitsecret"},
}
SECRET_KEYS = ("access_key", "secret_key", "connection_string", "credential")
SECRETS = ("AKIAUNITTESTKEY", "unit-test-secret", "unit-test-azure-key", "unitsecret")


def _load(storage: Any) -> Any:
    return load_config(None, raw={**BASE, "checkpoint_storage": storage}).config


@pytest.mark.parametrize("name", list(EVERY_KEY))
def test_every_key_of_every_determined_type_loads_and_no_secret_is_written_out(name: str) -> None:
    section = EVERY_KEY[name]
    storage = _load(section).checkpoint_storage
    assert storage.type == section["type"]
    for key, value in section.items():
        held = getattr(storage, key)
        assert (held.get_secret_value() if hasattr(held, "get_secret_value") else held) == value
    dumped = dump_config(_load(section))
    assert not any(secret in dumped for secret in SECRETS)
    reloaded = yaml.safe_load(dumped)["checkpoint_storage"]
    expected = {key: value for key, value in section.items() if key not in SECRET_KEYS}
    assert {key: reloaded[key] for key in expected} == expected
    assert all(reloaded.get(key) is None for key in SECRET_KEYS)


def test_secrets_reach_the_workers_through_the_environment_only() -> None:
    storage = _load(EVERY_KEY["s3"]).checkpoint_storage
    assert storage.secrets() == {"AWS_ACCESS_KEY_ID": "AKIAUNITTESTKEY", "AWS_SECRET_ACCESS_KEY": "unit-test-secret"}
    assert "unit-test-secret" not in repr(storage) and "unit-test-secret" not in str(storage)


def test_without_a_type_checkpoints_stay_in_the_run_dir(tmp_path: Path) -> None:
    config = _load({"save_trial_latest": 2})
    assert config.checkpoint_storage.type == "directory" and base_url(config.checkpoint_storage) is None
    info = prepare_run_dir(config, tmp_path / "run", FIXTURES, register=False)
    assert info.checkpoints.url == str((tmp_path / "run" / "checkpoints").resolve())


@pytest.mark.parametrize(("storage", "words"), [
    ({"type": "hdfs"}, "`checkpoint_storage.type` = 'hdfs' must be one of directory, shared_fs, s3, gcs, azure"),
    ({"type": "s3"}, "`checkpoint_storage.bucket` is required"),
    ({"type": "s3", "bucket": "ab"}, "is not a bucket name"),
    ({"type": "s3", "bucket": "abc", "prefix": "a/../b"}, "holds `..`"),
    ({"type": "s3", "bucket": "abc", "access_key": "k"}, "access_key and secret_key go together"),
    ({"type": "shared_fs", "host_path": "/mnt/a", "storage_path": "/mnt/b"}, "is absolute and not inside host_path"),
    ({"type": "azure", "container": "c"}, "exactly one of connection_string and account_url"),
    ({"type": "azure", "container": "c", "connection_string": "x", "credential": "y", "account_url": None},
     "credential goes with account_url"),
    ({"type": "directory", "bucket": "abc"}, "checkpoint_storage.bucket (abc) applies to s3 or gcs, not to "
                                             "`directory`"),
])
def test_bad_storage_gets_one_line(storage: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _load(storage)
    message = str(raised.value)
    assert words in message and "\n" not in message, message


def test_shared_fs_writes_under_host_path_and_storage_path_as_determined_does(tmp_path: Path) -> None:
    host = tmp_path / "shared"
    config = _load({"type": "shared_fs", "host_path": str(host), "storage_path": "team/ckpts",
                    "save_trial_latest": 2})
    prepare_storage(config.checkpoint_storage)
    info = prepare_run_dir(config, tmp_path / "run", FIXTURES, register=False)
    url = Path(info.checkpoints.url)
    assert url.parent == host / "team" / "ckpts" and url.name.startswith("digits_test-")
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["checkpoints"]["url"] == str(url)
    for step in (1, 2, 3):
        ckpt.write_checkpoint(info.checkpoints, step, {"w": torch.full((2,), float(step))}, {"trainer": {}})
    ckpt.prune_checkpoints(info.checkpoints, keep_latest=2, keep_steps=set())
    assert sorted(p.name for p in url.iterdir()) == ["latest", "step-2", "step-3"]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing in the run dir
    assert load_run_info(tmp_path / "run").checkpoints.url == str(url)  # a resume finds the same folder
    assert ckpt.find_resume_checkpoint(info.checkpoints).step == 3  # type: ignore[union-attr]


def test_an_absolute_storage_path_inside_host_path_is_taken_as_it_is(tmp_path: Path) -> None:
    host = tmp_path / "shared"
    config = _load({"type": "shared_fs", "host_path": str(host), "storage_path": str(host / "inside")})
    assert base_url(config.checkpoint_storage) == str(host / "inside")


def test_directory_container_path_gets_a_folder_per_run(tmp_path: Path) -> None:
    config = _load({"type": "directory", "container_path": str(tmp_path / "ckpts")})
    first = prepare_run_dir(config, tmp_path / "a", FIXTURES, register=False).checkpoints.url
    second = prepare_run_dir(config, tmp_path / "b", FIXTURES, register=False).checkpoints.url
    assert Path(first).parent == Path(second).parent == tmp_path / "ckpts" and first != second


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_gcs_without_its_library_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_storage.type gcs needs the gcsfs package, which is not "
                                          r"installed; pip install gcsfs"):
        require_library(_load(EVERY_KEY["gcs"]).checkpoint_storage)


@pytest.mark.skipif(importlib.util.find_spec("adlfs") is not None, reason="adlfs is installed here")
def test_azure_without_its_library_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match="needs the adlfs package"):
        require_library(_load(EVERY_KEY["azure"]).checkpoint_storage)


def test_a_folder_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot be created"):
        prepare_storage(_load({"type": "directory", "container_path": str(blocker / "sub")}).checkpoint_storage)


def test_a_typed_s3_url_takes_the_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = store_for_url("s3://bucket/prefix/run")
    assert store.options == {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    assert "key" not in CheckpointStore(url=store.url, options={"endpoint_url": "x"}).to_json()["options"]
