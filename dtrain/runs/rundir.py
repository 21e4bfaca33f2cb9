"""The run directory: where a run's files live, how a new one is registered and an old one resumed.

A run dir holds `config.yaml` (the resolved config, secrets left out), `run.json` (its ids in the store and where
its checkpoints go), `summary.json`, `checkpoints/` (unless `checkpoint_storage` sends them elsewhere: see
runs/storage.py), `tensorboard/`, `logs/` and, with `tracking.mlflow`, `mlflow-run.json`. Starting `dtrain run`
again on a run dir that holds an unfinished run of the same config resumes it; anything else is refused before a
file is touched.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dtrain.config import ExperimentConfig, dump_config
from dtrain.errors import LaunchError
from dtrain.runs.storage import CheckpointStore, new_store
from dtrain.runs.store import RunStore

CONFIG_FILE, RUN_FILE, SUMMARY_FILE = "config.yaml", "run.json", "summary.json"
# Config sections that may change between a run and its resumption.
RESUMABLE_CHANGES = ("faults", "debug", "max_restarts", "nan_policy", "max_consecutive_nan_skips", "tracking")
# Keys that may change between a run and its resumption because a resumed run keeps its global batch and cuts it
# over the new workers (dtrain.train.resize): the world size, the per-worker shares that follow from it, the
# passes a slot's batch is trained in (the update stays the whole batch's), and the ranks hsdp shards one replica
# over (its shard groups must divide the new size; distributed checkpoint reshards on load).
RESIZE_KEYS = ("resources.slots_per_trial", "distributed.heterogeneous.split", "optimizations.max_per_slot_batch",
               "distributed.hsdp.shard_size")


SEARCH_LINK_FILE = "search-trial.json"  # a search writes it into a trial's run dir before the run starts
MLFLOW_RUN_FILE = "mlflow-run.json"  # with tracking.mlflow: the MLflow run this run logs to (a resume continues it)


def runs_root() -> Path:
    """Root of default run dirs and of the store: $DTRAIN_RUNS_ROOT or ./runs."""
    return Path(os.environ.get("DTRAIN_RUNS_ROOT", "runs"))


def store_path() -> Path:
    return runs_root() / "metrics.db"


@dataclass(frozen=True)
class RunInfo:
    """Identity of a run: its directory and its ids in the store."""

    run_dir: Path
    experiment_id: int | None
    trial_id: int | None
    store: Path | None
    resumed: bool
    config_dir: Path  # directory of the experiment file: relative entrypoints and data paths start here
    checkpoints: CheckpointStore  # where the run's checkpoints go (no secrets)

    def to_json(self) -> dict[str, Any]:
        return {"experiment_id": self.experiment_id, "trial_id": self.trial_id,
                "store": str(self.store) if self.store else None, "config_dir": str(self.config_dir),
                "checkpoints": None if self.checkpoints.url == own_checkpoints(self.run_dir).url
                else self.checkpoints.to_json()}  # the run dir's own: found again where the run dir is now


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    found = []
    for key in keys:
        dotted = f"{prefix}{key}"
        if (not prefix and key in RESUMABLE_CHANGES) or dotted in RESIZE_KEYS:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differences(a, b, dotted + ".")
        elif a != b:
            found.append(f"{dotted}: {a!r} -> {b!r}")
    return found


def prepare_run_dir(config: ExperimentConfig, run_dir: Path | None, config_dir: Path, *, register: bool = True,
                    experiment_id: int | None = None) -> RunInfo:
    """Create or reopen a run dir; register a new run in the store when `register` (rank 0 / node 0 only): a new
    experiment, or a new trial of `experiment_id` (a search's). Nodes that start together on one run dir (shared
    by `dtrain run --rdzv-endpoint` on a shared file system) take turns: the first creates it, the others reopen it."""
    with _taking_turns(run_dir):
        return _prepare(config, run_dir, config_dir, register=register, experiment_id=experiment_id)


@contextmanager
def _taking_turns(run_dir: Path | None) -> Iterator[None]:
    """Hold an exclusive lock on the run dir's parent folder (flock; none where the file system refuses it)."""
    if run_dir is None:
        yield
        return
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(run_dir.parent, os.O_RDONLY)
    try:
        with suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _prepare(config: ExperimentConfig, run_dir: Path | None, config_dir: Path, *, register: bool,
             experiment_id: int | None) -> RunInfo:
    config_dir = config_dir.resolve()
    if run_dir is not None and (run_dir / CONFIG_FILE).is_file():
        return _reopen(config, run_dir, config_dir)
    if run_dir is not None and run_dir.exists() and any(p.name != SEARCH_LINK_FILE for p in run_dir.iterdir()):
        raise LaunchError(f"--run-dir {run_dir} exists and is not empty but holds no dtrain run ({CONFIG_FILE} is "
                          "missing); give a new or empty directory")
    store: RunStore | None = None
    trial_id = None
    if register:
        store = RunStore(store_path())
        if experiment_id is None or store.experiment(experiment_id) is None:
            experiment_id = store.create_experiment(config.name, config.description, dump_config(config))
    else:
        experiment_id = None
    if run_dir is None:
        run_dir = runs_root() / _safe_name(config.name) / str(experiment_id)
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if store is not None and experiment_id is not None:
        trial_id = store.create_trial(experiment_id, run_dir, config.hyperparameters, config.resources.world_size)
        store.close()
    (run_dir / CONFIG_FILE).write_text(dump_config(config))
    info = RunInfo(run_dir=run_dir, experiment_id=experiment_id, trial_id=trial_id,
                   store=store_path().resolve() if register else None, resumed=False, config_dir=config_dir,
                   checkpoints=new_store(config.checkpoint_storage, run_dir, config.name))
    write_json_atomic(run_dir / RUN_FILE, info.to_json())
    return info


def _reopen(config: ExperimentConfig, run_dir: Path, config_dir: Path) -> RunInfo:
    summary = read_summary(run_dir)
    if summary and summary.get("status") == "completed":
        raise LaunchError(f"run dir {run_dir} holds a completed run; give a new --run-dir (nothing was changed)")
    old = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
    new = config.model_dump(mode="json")
    changed = _differences(old, new)
    if changed:
        raise LaunchError(f"run dir {run_dir} holds a run with a different config ({'; '.join(changed[:3])}); "
                          "resume it with the same config or give a new --run-dir (nothing was changed)")
    ids: dict[str, Any] = {}
    if (run_dir / RUN_FILE).is_file():
        ids = json.loads((run_dir / RUN_FILE).read_text())
    dumped = dump_config(config)
    if (run_dir / CONFIG_FILE).read_text() != dumped:  # unchanged: workers of a running job may be reading it
        (run_dir / CONFIG_FILE).write_text(dumped)
    store = ids.get("store")
    info = RunInfo(run_dir=run_dir.resolve(), experiment_id=ids.get("experiment_id"), trial_id=ids.get("trial_id"),
                   store=Path(store) if store else None, resumed=True, config_dir=config_dir,
                   checkpoints=_checkpoints_of(ids, run_dir))
    write_json_atomic(run_dir / RUN_FILE, info.to_json())
    return info


def load_run_info(run_dir: Path) -> RunInfo:
    """The ids a prepared run dir records (workers read them; they never register)."""
    ids = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).is_file() else {}
    store = ids.get("store")
    checkpoints = _checkpoints_of(ids, run_dir)
    return RunInfo(run_dir=run_dir.resolve(), experiment_id=ids.get("experiment_id"), trial_id=ids.get("trial_id"),
                   store=Path(store) if store else None,
                   resumed=(run_dir / "checkpoints").is_dir(),
                   config_dir=Path(ids.get("config_dir") or run_dir), checkpoints=checkpoints)


def _checkpoints_of(ids: dict[str, Any], run_dir: Path) -> CheckpointStore:
    """The checkpoint store run.json records (a run dir from before it did: its own `checkpoints/`)."""
    recorded = ids.get("checkpoints")
    if isinstance(recorded, dict) and recorded.get("url"):
        return CheckpointStore.from_json(recorded)
    return own_checkpoints(run_dir)


def own_checkpoints(run_dir: Path) -> CheckpointStore:
    """The run dir's `checkpoints/` (the default storage)."""
    return CheckpointStore(url=str((run_dir / "checkpoints").resolve()))


def slurm_run_dir(name: str, job_id: str, node_rank: int = 0) -> Path:
    """The default run dir of a Slurm job: `<runs root>/<name>/slurm-<job id>`, and `...-node<N>` for node N > 0
    where each node keeps its own (`dtrain run` per node: two nodes must not prepare one dir at once). A requeued
    job keeps its id, so it finds this dir and resumes from its checkpoints."""
    return runs_root() / _safe_name(name) / (f"slurm-{job_id}" + (f"-node{node_rank}" if node_rank else ""))


def _safe_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("._")
    return cleaned or "experiment"
