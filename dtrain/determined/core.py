"""`det.core.init()`: Determined's Core API for a script that runs its own loop, on dtrain's run dir.

- `train`: training and validation metrics go into dtrain's store (`runs/metrics.db`) and the run's TensorBoard
  directory, as a Trial's do (chief only, as in Determined);
- `checkpoint`: `store_path`/`upload` write `checkpoints/determined/<storage id>/` in the run dir (the newest is
  what `get_cluster_info().latest_checkpoint` gives after a restart), `restore_path`/`download` read them;
- `searcher.operations()`: one operation whose `length` is `searcher.max_length` (in a search, the length the
  searcher gives the trial); `report_validation_metrics` tells the search the searcher metric, and once the
  searcher stops the trial (adaptive ASHA) `preempt.should_preempt()` is True on every rank;
- `preempt.should_preempt()`: also True after SIGTERM/SIGINT (Ctrl-C on `dtrain run`);
- `distributed`: the DistributedContext given, or one from torch.distributed's environment.

On leaving `init()`, the chief writes the run's summary (status `completed`, or `stopped` when the searcher
stopped it), as dtrain's Trainer does.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import shutil
import signal
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dtrain.determined.cluster import LATEST_FILE, ClusterInfo, core_checkpoint_root, run_dir_from_env
from dtrain.determined.distributed import DistributedContext
from dtrain.errors import ConfigError, TrialError

log = logging.getLogger("determined.core")


class PreemptMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHIEF_ONLY"
    ExplicitChief = "EXPLICIT_CHIEF"


class SearcherMode(enum.Enum):
    WorkersAskChief = "WORKERS_ASK_CHIEF"
    ChiefOnly = "CHIEF_ONLY"


class TensorboardMode(enum.Enum):
    AUTO = "AUTO"
    MANUAL = "MANUAL"


class _Run:
    """What the contexts share: the run dir, the config, the metrics writer, the search link, the stop flags."""

    def __init__(self, distributed: DistributedContext, checkpoint_storage: str | None) -> None:
        self.distributed = distributed
        self.run_dir = run_dir_from_env()
        self.on_dtrain = self.run_dir is not None
        if self.run_dir is None:  # Determined's local mode: checkpoints in checkpoint_storage or ./checkpoints
            self.run_dir = Path(checkpoint_storage) if isinstance(checkpoint_storage, str) else Path.cwd()
        self.config: dict[str, Any] = {}
        self.writer: Any = None
        self.link: Any = None
        self.started = time.time()
        self.steps_completed = 0
        self.validation: dict[str, float] = {}
        self.validations: list[dict[str, Any]] = []
        self.searcher_stopped = False
        self.signalled: str | None = None
        self.progress: float | None = None
        if self.on_dtrain:
            self._open_run()

    def _open_run(self) -> None:
        import yaml

        assert self.run_dir is not None
        self.config = yaml.safe_load((self.run_dir / "config.yaml").read_text()) or {}
        if self.distributed.rank != 0:
            return
        run = json.loads((self.run_dir / "run.json").read_text()) if (self.run_dir / "run.json").is_file() else {}
        from dtrain.config import Tracking
        from dtrain.train.metrics import MetricsWriter
        from dtrain.train.tracking import start_tracking

        store = run.get("store")
        tracker = start_tracking(Tracking.model_validate(self.config.get("tracking") or {}),
                                 name=str(self.config.get("name") or "experiment"),
                                 hyperparameters=dict(self.config.get("hyperparameters") or {}), run_dir=self.run_dir)
        self.writer = MetricsWriter(store_path=Path(store) if store else None, trial_id=run.get("trial_id"),
                                    tensorboard_dir=self.run_dir / "tensorboard", tracker=tracker)
        self.writer.status("running")
        self.link = _search_link(self.run_dir)

    @property
    def searcher(self) -> dict[str, Any]:
        return dict(self.config.get("searcher") or {})

    def close(self, failed: bool) -> None:
        if self.writer is None or self.run_dir is None:
            return
        status = "failed" if failed else "stopped" if self.searcher_stopped or self.signalled else "completed"
        latest = (core_checkpoint_root(self.run_dir) / LATEST_FILE)
        summary = {"status": status, "steps_completed": self.steps_completed, "epochs_completed": 0.0,
                   "world_size": self.distributed.size, "wall_seconds": time.time() - self.started,
                   "samples_per_second": 0.0, "validation": self.validation,
                   "validation_history": self.validations,
                   "checkpoint": latest.read_text().strip() if latest.is_file() else None,
                   "stopped_by_searcher": self.searcher_stopped, "entrypoint": "command (Determined Core API)"}
        if not failed:
            from dtrain.runs.rundir import SUMMARY_FILE, write_json_atomic

            write_json_atomic(self.run_dir / SUMMARY_FILE, summary)
        self.writer.status(status, summary)
        self.writer.close()


def _search_link(run_dir: Path) -> Any:
    """The trial's link to its search (dtrain.search.link), or None outside a search."""
    from dtrain.search.link import SearchLink

    return SearchLink.from_run_dir(run_dir)


class TrainContext:
    """`core_context.train`: metrics into dtrain's store and TensorBoard (the chief's; other ranks' are dropped,
    as in Determined)."""

    def __init__(self, run: _Run) -> None:
        self._run = run

    def report_training_metrics(self, steps_completed: int, metrics: Mapping[str, Any],
                                batch_metrics: Any = None) -> None:
        del batch_metrics
        self._run.steps_completed = max(self._run.steps_completed, int(steps_completed))
        if self._run.writer is not None:
            self._run.writer.training(int(steps_completed), 0.0, time.time() - self._run.started, _floats(metrics))
            self._run.writer.flush()  # a report: to the store's writer thread (and the MLflow tracker's) now

    def report_validation_metrics(self, steps_completed: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics; in a search, the searcher metric goes to the searcher, which may stop the trial
        (then `preempt.should_preempt()` turns True). The training done is the searcher's `time_metric` when the
        metrics hold it (`{"batches": 400, ...}`, as Determined 0.38 asks), else `steps_completed`."""
        values = _floats(metrics)
        run = self._run
        run.steps_completed = max(run.steps_completed, int(steps_completed))
        run.validation = values
        run.validations.append({"step": int(steps_completed), "metrics": values})
        if run.writer is not None:
            run.writer.validation(int(steps_completed), 0.0, time.time() - run.started, values)
        if run.link is not None and not run.searcher_stopped:
            metric = _searcher_metric(values, str(run.searcher.get("metric", "validation_loss")))
            if metric is not None:
                unit = run.link.max_length[1]  # the searcher's time_metric: reported with the metrics (Determined
                done = values.get(unit, float(steps_completed))  # 0.38's way), else the steps completed
                reason = run.link.report({unit: done}, metric)
                if reason is not None:
                    run.searcher_stopped = True
                    log.warning("the searcher stopped this trial at %s %s: %s", done, unit, reason)

    def report_metrics(self, group: str, steps_completed: int, metrics: Mapping[str, Any]) -> None:
        if group == "training":
            self.report_training_metrics(steps_completed, metrics)
        elif group == "validation":
            self.report_validation_metrics(steps_completed, metrics)
        elif self._run.writer is not None:
            self._run.writer.scalars(int(steps_completed), {f"{group}_{k}": v for k, v in _floats(metrics).items()})

    def report_progress(self, progress: float) -> None:
        del progress

    def set_status(self, status: str) -> None:
        log.info("status: %s", status)

    def get_experiment_best_validation(self) -> float | None:
        metric = str(self._run.searcher.get("metric", "validation_loss"))
        values = [v for v in (_searcher_metric(h["metrics"], metric) for h in self._run.validations) if v is not None]
        if not values:
            return None
        return min(values) if self._run.searcher.get("smaller_is_better", True) else max(values)


class CheckpointContext:
    """`core_context.checkpoint`: checkpoints in the run dir, each a directory named by its storage id."""

    def __init__(self, run: _Run) -> None:
        self._run = run
        assert run.run_dir is not None
        self._root = core_checkpoint_root(run.run_dir)

    def _new_id(self, shard: bool) -> str:
        storage_id = str(uuid.uuid4())
        return self._run.distributed.broadcast(storage_id) if shard else storage_id

    def _path(self, storage_id: str) -> Path:
        path = self._root / storage_id
        if not storage_id or "/" in storage_id or not path.is_dir():
            raise TrialError(f"checkpoint {storage_id!r} does not exist in {self._root}; give a storage id that "
                             "store_path()/upload() returned (or get_cluster_info().latest_checkpoint)")
        return path

    def _finish(self, storage_id: str, metadata: Mapping[str, Any] | None, shard: bool) -> None:
        if shard:
            self._run.distributed.allgather(None)  # every rank's files are in place
        if self._run.distributed.rank != 0:
            return
        meta = {**(metadata or {}), "steps_completed": (metadata or {}).get("steps_completed",
                                                                             self._run.steps_completed)}
        (self._root / storage_id / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
        tmp = self._root / f".{LATEST_FILE}.tmp"
        tmp.write_text(storage_id)
        tmp.replace(self._root / LATEST_FILE)

    @contextlib.contextmanager
    def store_path(self, metadata: Mapping[str, Any] | None = None, shard: bool = False
                   ) -> Iterator[tuple[Path, str]]:
        """A directory to write a checkpoint into, and its storage id; it becomes the latest checkpoint when the
        block ends. Without `shard`, only the chief may call it (Determined's rule)."""
        if not shard and self._run.distributed.rank != 0:
            raise TrialError("checkpoint.store_path() without shard=True is for the chief (rank 0) only; call it "
                             "there, or pass shard=True on every rank")
        storage_id = self._new_id(shard)
        path = self._root / storage_id
        path.mkdir(parents=True, exist_ok=True)
        yield path, storage_id
        self._finish(storage_id, metadata, shard)

    def upload(self, ckpt_dir: str | Path | None, metadata: Mapping[str, Any] | None = None,
               shard: bool = False) -> str:
        storage_id = self._new_id(shard)
        path = self._root / storage_id
        path.mkdir(parents=True, exist_ok=True)
        if ckpt_dir is not None:
            shutil.copytree(Path(ckpt_dir), path, dirs_exist_ok=True)
        self._finish(storage_id, metadata, shard)
        return storage_id

    @contextlib.contextmanager
    def restore_path(self, storage_id: str, selector: Any = None) -> Iterator[Path]:
        del selector
        yield self._path(storage_id)

    def download(self, storage_id: str, ckpt_dir: str | Path, selector: Any = None) -> None:
        del selector
        shutil.copytree(self._path(storage_id), Path(ckpt_dir), dirs_exist_ok=True)

    def get_metadata(self, storage_id: str) -> dict[str, Any]:
        meta = self._path(storage_id) / "metadata.json"
        return json.loads(meta.read_text()) if meta.is_file() else {}

    def delete(self, storage_id: str) -> None:
        shutil.rmtree(self._path(storage_id))


class SearcherOperation:
    """One unit of searcher work: train to `length` (in the searcher's unit), report progress and completion."""

    def __init__(self, run: _Run, length: int) -> None:
        self._run, self.length, self._completed = run, length, False

    def report_progress(self, length: float) -> None:
        self._run.progress = float(length)

    def report_completed(self, searcher_metric: Any) -> None:
        self._completed = True
        log.info("searcher operation completed at length %d with metric %s", self.length, searcher_metric)


class SearcherContext:
    """`core_context.searcher`: the length to train to."""

    def __init__(self, run: _Run) -> None:
        self._run = run

    def operations(self, searcher_mode: SearcherMode = SearcherMode.WorkersAskChief,
                   auto_ack: bool = True) -> Iterator[SearcherOperation]:
        """One operation of `searcher.max_length` (the search's length for this trial in a search); none once the
        searcher has stopped the trial."""
        del searcher_mode, auto_ack
        length = self._length()
        if not self._run.searcher_stopped:
            yield SearcherOperation(self._run, length)

    def _length(self) -> int:
        run = self._run
        if run.link is not None and run.link.max_length[0] > 0:  # 0: the command sets its own length
            value = int(run.link.max_length[0])
        else:
            configured = run.searcher.get("max_length")
            if configured is None:
                raise ConfigError("core_context.searcher.operations() needs searcher.max_length in the experiment "
                                  "file (the length to train to), e.g. `max_length: {batches: 100}` or "
                                  "`max_length: 100`")
            value = int(configured) if not isinstance(configured, Mapping) else int(next(iter(configured.values())))
        return int(run.distributed.broadcast(value))

    def get_configured_units(self) -> str | None:
        configured = self._run.searcher.get("max_length")
        return next(iter(configured)) if isinstance(configured, Mapping) else None


class PreemptContext:
    """`core_context.preempt`: whether to stop now (a signal, or the searcher stopped the trial), decided by the
    chief and the same on every rank (so every rank calls it at the same points, as in Determined)."""

    def __init__(self, run: _Run) -> None:
        self._run = run
        self._previous: dict[int, Any] = {}

    def _install(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            del frame
            self._run.signalled = signal.Signals(signum).name

        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[signum] = signal.signal(signum, handler)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous)

    def should_preempt(self, auto_ack: bool = True) -> bool:
        del auto_ack
        run = self._run
        decided = bool(run.searcher_stopped or run.signalled)
        return bool(run.distributed.broadcast(decided))

    def acknowledge_preemption_signal(self) -> None: ...


class Context:
    """What `det.core.init()` yields."""

    def __init__(self, run: _Run) -> None:
        self._run = run
        self.distributed = run.distributed
        self.train = TrainContext(run)
        self.checkpoint = CheckpointContext(run)
        self.searcher = SearcherContext(run)
        self.preempt = PreemptContext(run)
        self.info: ClusterInfo | None = None

    def close(self, failed: bool = False) -> None:
        self.preempt._restore()
        self._run.close(failed)
        if not failed:
            self.distributed.close()


@contextlib.contextmanager
def init(*, distributed: DistributedContext | None = None, checkpoint_storage: Any = None,
         preempt_mode: PreemptMode = PreemptMode.WorkersAskChief,
         tensorboard_mode: TensorboardMode = TensorboardMode.AUTO, async_checkpointing: bool = True
         ) -> Iterator[Context]:
    """The Core API context of this process (a context manager, as in Determined)."""
    del preempt_mode, tensorboard_mode, async_checkpointing
    from dtrain.determined.cluster import get_cluster_info

    distributed = distributed or (DistributedContext.from_torch_distributed() if run_dir_from_env()
                                  else DistributedContext.single())
    context = Context(_Run(distributed, checkpoint_storage))
    context.info = get_cluster_info()
    context.preempt._install()
    try:
        yield context
    except BaseException:
        context.close(failed=True)
        raise
    context.close()


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for name, value in metrics.items():
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number) or math.isnan(number):
            out[str(name)] = number
    return out


def _searcher_metric(values: Mapping[str, float], name: str) -> float | None:
    for key in (name, name.removeprefix("validation_"), f"validation_{name}"):
        if key in values:
            return values[key]
    return None
