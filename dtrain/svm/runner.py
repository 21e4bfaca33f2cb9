"""What a dtrain worker runs for an SVM trial instead of the Trainer: the distributed SMO in "batches" of
`global_batch_size` iterations, with checkpoints, restarts, fault injection, metrics and a summary.

Every rank builds the same data (the Trial's two datasets) and the same list of binary problems (one, or one
per class pair), solves them in turn over all ranks, and after each batch:
- reports the gap b_low - b_up, the active samples and the iteration count (store and TensorBoard, rank 0);
- writes a checkpoint every `min_checkpoint_period` batches and at the end: rank 0 gathers every rank's alpha,
  f (brought up to date for eliminated samples), active set and elimination streaks, plus the finished
  problems' models, into `checkpoints/step-<N>/` (the same atomic, checksummed layout as the Trainer's);
- runs the config's `faults.kills` before a batch (a rank SIGKILLed there is restarted by the launcher, and
  every rank resumes from the latest checkpoint; the solve then ends with the same alphas as without the kill).
At the end it validates the model on the validation data (accuracy) and writes summary.json with the SMO's
figures: iterations, kernel evaluations, communication time, eliminations per rank, reconstructions, the final
KKT gap over all samples.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from dtrain.comm import Topology, barrier
from dtrain.config import ExperimentConfig
from dtrain.data.sharding import split_global_batch
from dtrain.errors import ConfigError, TrialError
from dtrain.runs.rundir import SUMMARY_FILE, RunInfo, write_json_atomic
from dtrain.svm.binary import BinaryModel, gather_model, make_solver
from dtrain.svm.estimator import SVC, summarize
from dtrain.svm.solver import DistributedSMO
from dtrain.train import checkpoint as ckpt
from dtrain.train.checkpointing import agreed_store
from dtrain.train.faults import FAULTS_FILE, FaultInjector
from dtrain.train.metrics import MetricsWriter
from dtrain.train.progress import Progress
from dtrain.train.tracking import start_tracking
from dtrain.train.trial import Trial, TrialContext

log = logging.getLogger(__name__)


def arrays(dataset: Any) -> tuple[np.ndarray, np.ndarray]:
    """(features as (n, d) float64, labels) from a dataset of (features, labels) tensors."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is None or len(tensors) != 2:
        raise TrialError("the SVM trial's datasets must be ArrayDatasets of (features, labels); got "
                         f"{type(dataset).__name__}")
    features, labels = tensors
    return features.reshape(len(features), -1).double().numpy(), labels.numpy()


def _batches(length: Any, what: str) -> int:
    if length.unit != "batches":
        raise ConfigError(f"{what} is in {length.unit}; an SVM trial counts in batches of global_batch_size SMO "
                          f"iterations: write e.g. `{what.split('.')[0]}: {{batches: 100}}`")
    return int(length.value)


class SVMRunner:
    """Trains one SVM trial in this worker, in lockstep with the other ranks (`fit()`, then `status`)."""

    def __init__(self, *, config: ExperimentConfig, trial_class: type[Trial], topology: Topology,
                 run_info: RunInfo, stop_advisor: Any = None) -> None:
        """`stop_advisor` (a search's rung decisions) is accepted and not used: an SMO solve has no rungs, and a
        search over C and gamma compares the finished trials' validation accuracy."""
        del stop_advisor
        self.config = config
        self.topology = topology
        self.run_dir = run_info.run_dir
        self.checkpoints = agreed_store(run_info.checkpoints, topology)
        self.iterations_per_batch = config.global_batch_size
        self.total_batches = _batches(config.searcher.max_length, "searcher.max_length")
        self.checkpoint_every = _batches(config.min_checkpoint_period, "min_checkpoint_period")
        context = TrialContext(
            hparams=config.hyperparameters, rank=topology.rank, world_size=topology.world_size,
            local_rank=topology.local_rank, batch_split=split_global_batch(config.global_batch_size,
                                                                           topology.world_size),
            device=topology.device, seed=config.reproducibility.experiment_seed, data_config=config.data,
            run_dir=self.run_dir, config_dir=run_info.config_dir)
        self.trial = trial_class(context)
        build = getattr(self.trial, "build_estimator", None)
        if build is None:
            raise TrialError(f"{trial_class.__name__} names the SVM runner but has no build_estimator(); "
                             "subclass dtrain.svm.trial.SVMTrial")
        self.estimator: SVC = build()
        features, labels = arrays(self.trial.build_training_data())
        self.val_features, self.val_labels = arrays(self.trial.build_validation_data())
        self.features, self.labels, self.problems = self.estimator.plan(features, labels)
        self.faults = FaultInjector(config.faults, topology.rank, record_path=self.run_dir / "logs" / FAULTS_FILE,
                                    restart_count=topology.restart_count)
        chief = topology.is_chief
        tracker = (start_tracking(config.tracking, name=config.name, hyperparameters=config.hyperparameters,
                                  run_dir=self.run_dir) if chief else None)
        self.metrics = MetricsWriter(store_path=run_info.store if chief else None, trial_id=run_info.trial_id,
                                     tensorboard_dir=self.run_dir / "tensorboard" if chief else None, tracker=tracker)
        self.progress = Progress(self.total_batches, 0, self.iterations_per_batch, enabled=chief)
        self.status = "running"
        self.step = 0
        self.models: list[BinaryModel] = []
        self.resume_state: dict[str, Any] | None = None
        self.resumes = 0
        self.newest: ckpt.CheckpointRef | None = None
        self.wall_before = 0.0
        self._resume()

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        ref = ckpt.find_resume_checkpoint(self.checkpoints)
        if ref is None:
            return
        arrays_, state = ckpt.load_checkpoint(ref)
        self.step = int(state["step"])
        self.resumes = int(state.get("resumes", 0)) + 1
        self.wall_before = float(state.get("wall_seconds", 0.0))
        self.newest = ref
        for p, saved in enumerate(state["models"]):
            self.models.append(BinaryModel(
                support=arrays_[f"p{p}.support"].numpy(), coef=arrays_[f"p{p}.coef"].numpy(),
                vectors=self._vectors(p, arrays_[f"p{p}.support"].numpy()), rho=float(saved["rho"]),
                dual_objective=float(saved["dual_objective"]), stats=list(saved["stats"])))
        if "current.alpha" in arrays_:
            self.resume_state = {"alpha": arrays_["current.alpha"].numpy(), "f": arrays_["current.f"].numpy(),
                                 "active": arrays_["current.active"].numpy(),
                                 "streak": arrays_["current.streak"].numpy(), **state["current"]}
        self.progress.note(f"{self.config.name}: resumed from checkpoint {ref.name} (batch {self.step}, "
                           f"{len(self.models)} of {len(self.problems)} problem(s) solved)")

    def _vectors(self, p: int, support: np.ndarray) -> np.ndarray:
        rows = self.features[self.problems[p].rows[support]]
        return np.asarray(rows.toarray()) if hasattr(rows, "toarray") else np.array(rows)

    def _checkpoint(self, solver: DistributedSMO | None) -> None:
        """Every rank's part of the current problem, written by rank 0 (a collective)."""
        current = solver.local_state() if solver is not None else None
        parts: list[Any] = (solver.exchange.gather_objects(current) if solver is not None else [None])
        if not self.topology.is_chief:
            barrier()
            return
        tensors: dict[str, torch.Tensor] = {}
        for p, model in enumerate(self.models):
            tensors[f"p{p}.support"] = torch.from_numpy(model.support.copy())
            tensors[f"p{p}.coef"] = torch.from_numpy(model.coef.copy())
        state: dict[str, Any] = {"step": self.step, "resumes": self.resumes, "wall_seconds": self._wall(),
                                 "models": [{"rho": m.rho, "dual_objective": m.dual_objective, "stats": m.stats}
                                            for m in self.models]}
        if current is not None:
            ordered = sorted(parts, key=lambda part: part["start"])
            for name in ("alpha", "f", "active", "streak"):
                tensors[f"current.{name}"] = torch.from_numpy(np.concatenate([part[name] for part in ordered]))
            state["current"] = {"problem": len(self.models), "iterations": int(ordered[0]["stats"]["iterations"]),
                                "done": bool(ordered[0]["done"]),
                                "stats": [part["stats"] for part in parts]}
        self.newest = ckpt.write_checkpoint(self.checkpoints, self.step, tensors, state,
                                            extra_meta={"kind": "svm"},
                                            after_model_file=lambda: self.faults.during_checkpoint(self.step))
        self.metrics.checkpoint(self.step, str(self.newest.path))
        ckpt.prune_checkpoints(self.checkpoints, keep_latest=2, keep_steps=set())
        barrier()

    # ------------------------------------------------------------------ the run

    def _wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def fit(self) -> dict[str, Any]:
        from threadpoolctl import threadpool_limits

        self.started = time.perf_counter()
        self.metrics.status("running")
        self.progress.note(f"{self.config.name}: {'resuming' if self.resumes else 'starting'} an SVM "
                           f"({self.estimator.kernel} kernel, C={self.estimator.C}, shrinking="
                           f"{self.estimator.shrinking}) on {self.topology.world_size} worker(s): "
                           f"{len(self.labels)} samples, {len(self.problems)} binary problem(s), "
                           f"{self.iterations_per_batch} SMO iterations per batch")
        try:
            with threadpool_limits(limits=int(self.estimator.blas_threads), user_api="blas"):
                self._solve_all()
        finally:
            self.progress.close()
        return self._finish()

    def _solve_all(self) -> None:
        while len(self.models) < len(self.problems):
            p = len(self.models)
            problem = self.problems[p]
            solver = make_solver(self.features[problem.rows], problem.labels, problem.params,
                                 self.topology.rank, self.topology.world_size)
            self._load_into(solver, p)
            done = solver.done
            while not done:
                if self.step >= self.total_batches:
                    self.status = "stopped"
                    self.progress.note(f"searcher.max_length ({self.total_batches} batches) reached before the "
                                       f"SMO converged (gap {solver.b_low - solver.b_up:.3g} > tol); the model "
                                       "was not finished: raise max_length or global_batch_size")
                    self._checkpoint(solver)
                    return
                self.step += 1
                self.faults.before_step(self.step)
                done = solver.solve(self.iterations_per_batch)
                self._report(p, solver)
                if done:
                    solver.exchange.close()
                    self.models.append(gather_model(solver))
                    self._checkpoint(None)  # the finished model; the last one's is the final checkpoint
                elif self.checkpoint_every and self.step % self.checkpoint_every == 0:
                    self._checkpoint(solver)
        self.status = "completed"

    def _load_into(self, solver: DistributedSMO, p: int) -> None:
        saved = self.resume_state
        if saved is None or int(saved["problem"]) != p:
            return
        solver.load_global(saved["alpha"], saved["f"], saved["active"], saved["streak"], int(saved["iterations"]),
                           bool(saved["done"]))
        stats = saved["stats"]
        mine = stats[self.topology.rank] if len(stats) == self.topology.world_size else stats[0]
        for key, value in mine.items():
            if key not in ("iterations", "converged", "exchange") and hasattr(solver.stats, key):
                setattr(solver.stats, key, value)
        self.resume_state = None

    def _report(self, p: int, solver: DistributedSMO) -> None:
        stats = solver.stats
        values = {"gap": solver.b_low - solver.b_up, "active_samples": float(len(solver.pos)),
                  "iterations": float(stats.iterations), "problem": float(p),
                  "eliminated": float(stats.eliminated), "reactivated": float(stats.reactivated),
                  "comm_seconds": stats.comm_seconds}
        if self.topology.is_chief:
            self.metrics.training(self.step, 0.0, self._wall(), values)
            self.metrics.flush()
            if self.step % 10 == 0 or solver.done:
                self.progress.note(f"batch {self.step}: problem {p + 1}/{len(self.problems)}, {stats.iterations} "
                                   f"iterations, gap {values['gap']:.4g}, {len(solver.pos)} active samples on rank 0")

    # ------------------------------------------------------------------ the end

    def _finish(self) -> dict[str, Any]:
        summary: dict[str, Any] = {"status": self.status, "world_size": self.topology.world_size,
                                   "global_batch_size": self.iterations_per_batch, "steps_completed": self.step,
                                   "epochs_completed": None, "samples_per_second": None}  # an SMO solve has neither
        validation: dict[str, float] = {}
        if self.status == "completed":
            self.estimator.adopt(self.features, self.labels, self.problems, self.models)
            if self.topology.is_chief:
                accuracy = float(self.estimator.score(self.val_features, self.val_labels))
                validation = {"accuracy": accuracy, "error": 1.0 - accuracy}
                self.metrics.validation(self.step, 0.0, self._wall(), validation)
            summary["svm"] = self._figures()
        history = [{"step": self.step, "epoch": 0.0, "wall_seconds": self._wall(), "metrics": validation}]
        summary.update({"wall_seconds": self._wall(), "validation": validation,
                        "validation_history": history if validation else [],
                        "checkpoint": str(self.newest.model_path) if self.newest else None,
                        "restarts": self.topology.restart_count, "resumes": self.resumes,
                        "tensorboard": str(self.run_dir / "tensorboard")})
        if self.topology.is_chief:
            write_json_atomic(self.run_dir / SUMMARY_FILE, summary)
            self.metrics.status(self.status, summary)
            line = (f"SVM {self.status}: {summary['svm']['iterations']} SMO iterations, validation accuracy "
                    f"{validation.get('accuracy', float('nan')):.4f}, {summary['svm']['n_support']} support vectors"
                    if self.status == "completed" else f"SVM {self.status} after batch {self.step}")
            self.progress.note(line)
        self.metrics.close()
        return summary

    def _figures(self) -> dict[str, Any]:
        figures = summarize([{"dual_objective": m.dual_objective, "ranks": m.stats} for m in self.models])
        figures["n_support"] = int(len(self.estimator.support_))
        figures["n_samples"] = int(len(self.labels))
        figures["kernel"] = self.estimator.kernel
        figures["shrinking"] = str(self.estimator.shrinking)
        return figures
