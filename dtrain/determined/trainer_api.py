"""Determined's Trainer API: `with det.pytorch.init() as context: Trainer(MyTrial(context), context).fit(...)`.

The script runs as a command entrypoint on every slot (or by hand: Determined's local mode, one process, a run dir
of its own). `init()` joins the job (torch.distributed from the launcher's variables), reads the experiment file
from the run dir, seeds the weights as dtrain's Trainer would, and yields the PyTorchTrialContext; `fit()` runs
dtrain's Trainer over the trial through the same adapter as a `model_def:Trial` entrypoint, so the two forms
train identically. The lengths `fit()` is given fill in what the experiment file leaves unset;
`searcher.max_length` from the file (or from the search) comes first, as the searcher's length does in
Determined.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dtrain.determined.adapter import PyTorchTrial, adapter_for
from dtrain.determined.cluster import run_dir_from_env
from dtrain.determined.context import PyTorchTrialContext
from dtrain.determined.distributed import DistributedContext
from dtrain.determined.pytorch import Batch, TrainUnit
from dtrain.errors import ConfigError, TrialError

log = logging.getLogger("determined.pytorch")



class _Job:
    """What init() set up and fit() needs: the config, the topology, the run."""

    def __init__(self, config: Any, topology: Any, run_info: Any, local: bool) -> None:
        self.config, self.topology, self.run_info, self.local = config, topology, run_info, local


@contextlib.contextmanager
def init(*, hparams: Mapping[str, Any] | None = None, exp_conf: Mapping[str, Any] | None = None,
         distributed: DistributedContext | None = None, aggregation_frequency: int = 1,
         enable_tensorboard_logging: bool = True) -> Iterator[PyTorchTrialContext]:
    """The PyTorchTrialContext of this process. Under `dtrain run` the experiment file gives the hyperparameters
    and settings; run by hand, `hparams` and `exp_conf` do (a one-process run in a run dir of its own)."""
    del enable_tensorboard_logging
    from dtrain.comm import init_distributed
    from dtrain.config import load_config, read_yaml
    from dtrain.data.sharding import split_global_batch
    from dtrain.runs.rundir import load_run_info, prepare_run_dir
    from dtrain.train.rng import seed_everything
    from dtrain.train.trial import TrialContext

    run_dir = run_dir_from_env()
    if run_dir is not None:
        loaded = load_config(None, raw=read_yaml(run_dir / "config.yaml"))
        run_info = load_run_info(run_dir)
    else:
        raw: dict[str, Any] = {"name": "determined-local", **dict(exp_conf or {})}
        raw.setdefault("hyperparameters", dict(hparams or {}))
        raw["entrypoint"] = ["python3", *sys.argv[:1]]  # the script run by hand: a command, as on a cluster
        raw.setdefault("searcher", {"name": "single", "metric": "validation_loss"})  # fit() gives the length
        raw.setdefault("optimizations", {}).setdefault("aggregation_frequency", aggregation_frequency)
        loaded = load_config(None, raw=raw)
        run_info = prepare_run_dir(loaded.config, None, Path.cwd())
        os.environ["DTRAIN_RUN_DIR"] = str(run_info.run_dir.resolve())
    config = loaded.config
    topology = init_distributed(backend=config.distributed.backend, device=config.distributed.device,
                                timeout_seconds=config.distributed.timeout_seconds)
    # without hyperparameters.global_batch_size (Determined 0.38 files), the trial's data loader says it: fit()
    # reads its batch size; until then the context has one record per slot and get_*_batch_size() refuse
    batch_size = int(config.hyperparameters.get("global_batch_size", topology.world_size))
    seed = config.reproducibility.experiment_seed
    seed_everything(seed)  # the trial's weights, built before fit(), start where dtrain's Trainer would seed them
    trial_context = TrialContext(
        hparams=config.hyperparameters, rank=topology.rank, world_size=topology.world_size,
        local_rank=topology.local_rank, batch_split=split_global_batch(batch_size, topology.world_size),
        device=topology.device, seed=seed, data_config=config.data, run_dir=run_info.run_dir,
        config_dir=run_info.config_dir, aggregation_frequency=config.optimizations.aggregation_frequency,
        experiment_config=config)
    context = PyTorchTrialContext(trial_context, config, distributed=distributed or DistributedContext(
        rank=topology.rank, size=topology.world_size, local_rank=topology.local_rank,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size)), cross_rank=topology.node_rank,
        cross_size=max(topology.world_size // max(int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size)), 1),
                       1)))
    # dtrain's job details ride on Determined's context object, which has no field for them
    context._job = _Job(config, topology, run_info, local=run_dir is None)  # type: ignore[attr-defined]
    yield context


class Trainer:
    """Trains a PyTorchTrial with dtrain's Trainer (`fit`), from a script."""

    def __init__(self, trial: PyTorchTrial, context: PyTorchTrialContext | None = None) -> None:
        if not isinstance(trial, PyTorchTrial):
            raise TrialError(f"Trainer() got {type(trial).__name__}; give it a determined.pytorch.PyTorchTrial")
        self.trial = trial
        self.context = context or trial.context
        if getattr(self.context, "_job", None) is None:
            raise TrialError("Trainer(trial, context): the context must come from `with det.pytorch.init() as "
                             "context:`")

    def _loader_batch_size(self) -> int:
        """The per-slot batch size of the trial's training data loader (when the file gives no global one)."""
        return _loader_batch_size_of(self.trial)

    def fit(self, checkpoint_period: TrainUnit | None = None, validation_period: TrainUnit | None = None,
            max_length: TrainUnit | None = None, reporting_period: TrainUnit | None = None,
            checkpoint_policy: str = "best", latest_checkpoint: str | None = None, step_zero_validation: bool = False,
            test_mode: bool = False, profiling_enabled: bool = False) -> dict[str, Any]:
        """Train to `searcher.max_length` (or `max_length` when the experiment file sets none); resume from the
        run dir's latest checkpoint (`latest_checkpoint` names the same one after a restart and is not needed)."""
        del latest_checkpoint, test_mode, profiling_enabled
        from dtrain.config import load_config
        from dtrain.train.trainer import Trainer as DtrainTrainer

        # set by init() on the context that fit() is called with
        job = self.context._job  # type: ignore[attr-defined]
        raw = job.config.model_dump(mode="json")
        searcher = raw["searcher"]
        if max_length is not None and (searcher.get("max_length") is None or job.local):
            searcher["max_length"] = _length(max_length, "max_length")
        elif searcher.get("max_length") is None:
            raise ConfigError("Trainer.fit() needs a length: give fit(max_length=pytorch.Epoch(1)) or set "
                              "searcher.max_length in the experiment file")
        elif max_length is not None and _length(max_length, "max_length") != searcher["max_length"]:
            log.info("fit(max_length=%s): the experiment's searcher.max_length %s is used", max_length,
                     searcher["max_length"])
        if validation_period is not None:
            raw["min_validation_period"] = _length(validation_period, "validation_period")
        if checkpoint_period is not None:
            raw["min_checkpoint_period"] = _length(checkpoint_period, "checkpoint_period")
        if reporting_period is not None:
            if not isinstance(reporting_period, Batch):
                raise ConfigError(f"fit(reporting_period={reporting_period!r}): give pytorch.Batch(N)")
            raw["scheduling_unit"] = max(reporting_period.value, 1)
        if checkpoint_policy not in ("best", "all", "none"):
            raise ConfigError(f"fit(checkpoint_policy={checkpoint_policy!r}): use best, all or none")
        raw["checkpoint_policy"] = checkpoint_policy
        raw["perform_initial_validation"] = bool(step_zero_validation or raw.get("perform_initial_validation"))
        if "global_batch_size" not in raw["hyperparameters"]:
            raw["hyperparameters"]["global_batch_size"] = self._loader_batch_size() * job.topology.world_size
        config = load_config(None, raw=raw).config
        adapter = adapter_for(type(self.trial))

        def build(trial_context: Any) -> Any:
            # adapter_for gives a Trial whose __init__ also takes Determined's context and trial
            return adapter(trial_context, det_context=self.context, det_trial=self.trial)  # type: ignore[call-arg]

        # a factory called as the Trial class would be: the Trainer only calls trial_class(context)
        trainer = DtrainTrainer(config=config, trial_class=build,  # type: ignore[arg-type]
                                topology=job.topology, run_info=job.run_info,
                                stop_advisor=_search_advisor(job.run_info.run_dir))
        summary = trainer.fit()
        if trainer.status == "interrupted":
            raise SystemExit(130)
        return summary


def _search_advisor(run_dir: Path) -> Any:
    """The searcher's stop advisor when the run is a trial of a search (adaptive ASHA stops it after a validation)."""
    from dtrain.search.link import LinkAdvisor, SearchLink

    link = SearchLink.from_run_dir(run_dir)
    return LinkAdvisor(link) if link is not None else None


def _loader_batch_size_of(trial: PyTorchTrial) -> int:
    loader = trial.build_training_data_loader()
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        raise ConfigError("the experiment file has no hyperparameters.global_batch_size and the training data "
                          "loader no batch_size; give one of them")
    return size


def _length(unit: TrainUnit, name: str) -> dict[str, int]:
    if not isinstance(unit, TrainUnit):
        raise ConfigError(f"fit({name}={unit!r}): give pytorch.Batch(N) or pytorch.Epoch(N)")
    return {unit.unit: unit.value}
