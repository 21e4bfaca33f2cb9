"""`det.get_cluster_info()`: what a trial may know about where it runs. dtrain has no master, so the info comes from
the run dir the worker was started for (`DTRAIN_RUN_DIR`): its hyperparameters, its trial id in the store, its
rank, and the newest checkpoint a Core API script stored (what Determined calls `latest_checkpoint`)."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "DTRAIN_RUN_DIR"
CORE_CHECKPOINTS = "determined"  # under the run dir's checkpoints/: what checkpoint.store_path() writes
LATEST_FILE = "latest"


@dataclass
class TrialInfo:
    """Determined's `ClusterInfo.trial`: the trial's id, its experiment's, its hyperparameters and config."""

    trial_id: int
    experiment_id: int
    hparams: dict[str, Any]
    config: dict[str, Any]
    trial_seed: int = 0
    user_data: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterInfo:
    """The part of Determined's `ClusterInfo` that has a meaning here (no master, agents or session tokens)."""

    master_url: str
    cluster_id: str
    agent_id: str
    slot_ids: list[int]
    task_id: str
    allocation_id: str
    session_token: str
    task_type: str
    latest_checkpoint: str | None
    trial: TrialInfo
    container_rank: int
    container_addrs: list[str]
    run_dir: Path

    @property
    def user_data(self) -> dict[str, Any]:
        return self.trial.user_data


def run_dir_from_env() -> Path | None:
    """The run dir dtrain started this process for, or None outside dtrain."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def core_checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / CORE_CHECKPOINTS


def latest_core_checkpoint(run_dir: Path) -> str | None:
    """The storage id of the newest checkpoint `checkpoint.store_path()`/`upload()` completed in this run dir."""
    latest = core_checkpoint_root(run_dir) / LATEST_FILE
    if not latest.is_file():
        return None
    storage_id = latest.read_text().strip()
    return storage_id if (core_checkpoint_root(run_dir) / storage_id).is_dir() else None


def get_cluster_info() -> ClusterInfo | None:
    """The ClusterInfo of this process, or None when it was not started by dtrain (Determined's local mode)."""
    run_dir = run_dir_from_env()
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    rank = int(os.environ.get("RANK", "0"))
    trial = TrialInfo(trial_id=int(run.get("trial_id") or 0), experiment_id=int(run.get("experiment_id") or 0),
                      hparams=dict(config.get("hyperparameters") or {}), config=config,
                      trial_seed=int((config.get("reproducibility") or {}).get("experiment_seed", 0)))
    return ClusterInfo(master_url="", cluster_id="dtrain", agent_id=socket.gethostname(),
                       slot_ids=[int(os.environ.get("LOCAL_RANK", "0"))], task_id=str(run_dir),
                       allocation_id=str(run_dir), session_token="", task_type="TRIAL",
                       latest_checkpoint=latest_core_checkpoint(run_dir), trial=trial,
                       container_rank=int(os.environ.get("GROUP_RANK", "0")) if rank else 0,
                       container_addrs=[os.environ.get("MASTER_ADDR", "127.0.0.1")], run_dir=run_dir)
