"""One worker process: `python -m dtrain.worker --run-dir DIR [CONFIG] [--set key=value ...]`.

`dtrain run` starts one per slot through torchrun's elastic agent, after it has prepared DIR. The same
entry also runs under a plain `torchrun ... -m dtrain.worker CONFIG --run-dir DIR` or under Slurm's
`srun`; then it prepares DIR itself (local rank 0 of each node). A user error (bad data, a broken Trial)
is written to DIR/fatal-error.json and exits with code 2, so that the run ends at once instead of
repeating it. An exception in user code is recorded (`runs/repeats.py`) and exits with code 1: the agent
restarts the workers, which resume from the latest checkpoint, unless the attempt before met the same
exception at the same batch; then it is a user error too. A lost peer exits with code 1 and is restarted.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.errors import DtrainError, ExitCode, LaunchError, StallError
from dtrain.runs.fatal import launch_id, read_fatal, write_fatal
from dtrain.runs.repeats import describe_exception, record_exception, recorded

if TYPE_CHECKING:
    from dtrain.sync import StrategySpec


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (its options are part of the CLI snapshot, like `dtrain`'s)."""
    parser = argparse.ArgumentParser(prog="python -m dtrain.worker",
                                     description="Run one dtrain worker (started by dtrain run, torchrun or srun).")
    parser.add_argument("config", nargs="?", help="experiment YAML (omit when DIR was prepared by `dtrain run`)")
    parser.add_argument("--run-dir", type=Path, help="the run directory shared by all workers (required, except in a "
                        "Slurm job with CONFIG: runs/<name>/slurm-<job id>, where a requeued job resumes)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (only with CONFIG)")
    return parser


def _setup_logging(run_dir: Path, rank: int, name: str | None = None, debug: bool = False) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name or f'rank-{rank}'}.log"
    if rank != 0:  # everything a non-chief rank prints, C++ warnings included, goes to its file
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.addHandler(handler)
    if rank == 0:
        from dtrain.train.progress import ConsoleHandler

        root.addHandler(ConsoleHandler(logging.WARNING))
    for noisy in ("torch.distributed", "torch.nn.parallel"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _threads_per_worker(local_world_size: int) -> int:
    """OMP_NUM_THREADS, else this machine's cores shared by its workers (as `dtrain run` sets it: the same thread
    count, and so the same sums, however the workers were started)."""
    from dtrain.runs.processes import threads_per_process

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    return threads_per_process(local_world_size, os.environ)


def run_worker(args: argparse.Namespace, progress: _Progress | None = None) -> int:
    """Prepare this process, train, and return the exit code (`progress` learns the Trainer, to say where an
    exception in user code was raised)."""
    import torch

    from dtrain.comm import barrier, init_distributed, read_launch_env
    from dtrain.config import check_buildable, load_config, read_yaml
    from dtrain.determined.entrypoint import load_trial
    from dtrain.runs.rundir import CONFIG_FILE, load_run_info, prepare_run_dir, slurm_run_dir
    from dtrain.train.trainer import Trainer

    launch = read_launch_env()
    if args.config is not None:
        loaded = load_config(args.config, args.overrides)
        if args.run_dir is None:
            args.run_dir = slurm_run_dir(loaded.config.name, os.environ["SLURM_JOB_ID"])
    run_dir: Path = args.run_dir
    if args.config is None:
        if not (run_dir / CONFIG_FILE).is_file():
            raise LaunchError(f"{run_dir / CONFIG_FILE} does not exist; pass the experiment YAML as CONFIG")
        loaded = load_config(None, raw=read_yaml(run_dir / CONFIG_FILE))
    config = loaded.config
    check_buildable(config)
    os.environ.update(config.checkpoint_storage.secrets())  # from an experiment file given here (none in config.yaml)
    if config.is_command:  # a command entrypoint: this process becomes the command (Determined's launch form)
        from dtrain.determined.command import exec_command

        config_dir = loaded.base_dir if args.config is not None else load_run_info(run_dir).config_dir
        exec_command(config.entry.argv, run_dir, config_dir, launch.rank)
    torch.set_num_threads(_threads_per_worker(launch.local_world_size))
    from dtrain.sync import strategy_spec

    spec = strategy_spec(config.distributed.strategy)
    servers = spec.servers(config)
    interface = os.environ.get("DTRAIN_NETWORK_INTERFACE") or config.distributed.network_interface
    topology = init_distributed(backend=config.distributed.backend, timeout_seconds=config.distributed.timeout_seconds,
                                servers=servers, network_interface=interface, device=config.distributed.device)
    if topology.is_server:
        config_dir = loaded.base_dir if args.config is not None else load_run_info(run_dir).config_dir
        return _serve(run_dir, config, topology, config_dir, spec)
    if args.config is not None:  # the chief's node first: on a shared file system the other nodes find it prepared
        if launch.local_rank == 0 and launch.node_rank == 0:
            prepare_run_dir(config, run_dir, loaded.base_dir, register=True)
        barrier()
        if launch.local_rank == 0 and launch.node_rank != 0 and not (run_dir / CONFIG_FILE).is_file():
            prepare_run_dir(config, run_dir, loaded.base_dir, register=False)
        barrier()
    _setup_logging(run_dir, topology.rank, debug=config.debug)
    if topology.is_chief:
        for warning in loaded.warnings if args.config is not None else []:
            logging.getLogger("dtrain").warning(warning)
    run_info = load_run_info(run_dir)
    if topology.world_size != config.resources.world_size and topology.is_chief:
        logging.getLogger("dtrain").warning("running with %d workers where resources.slots_per_trial says %d; "
                                            "the global batch is split over %d", topology.world_size,
                                            config.resources.world_size, topology.world_size)
    os.environ["DTRAIN_RUN_DIR"] = str(run_dir.resolve())  # det.get_cluster_info() in a PyTorchTrial
    trial_class = load_trial(config, run_info.config_dir)
    # a Trial that is not trained by gradient steps (dtrain.svm's) names its own runner; others get the Trainer
    runner = getattr(trial_class, "dtrain_runner", Trainer)
    trainer = runner(config=config, trial_class=trial_class, topology=topology, run_info=run_info,
                     stop_advisor=_search_advisor(run_dir))
    if progress is not None:
        progress.trainer = trainer
    trainer.fit()
    barrier()
    if trainer.status != "interrupted":
        return ExitCode.OK
    if launch.launcher == "slurm":  # one process per slot: no `dtrain run` to requeue the job, rank 0 does
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # the checkpoint is written: the requeue's SIGTERM ends nothing
            signal.signal(sig, signal.SIG_IGN)
        if topology.is_chief:
            _requeue_if_asked(run_dir, getattr(trainer, "stop", None))
        barrier()  # no rank leaves before rank 0 has requeued: srun --kill-on-bad-exit would kill it on the way
    return ExitCode.INTERRUPTED


def _requeue_if_asked(run_dir: Path, stop: Any) -> None:
    """Rank 0 of a Slurm job started per slot, once every rank has stopped with the checkpoint on a signal: when
    Slurm preempted the job or the signal was SIGUSR1, record the preemption and requeue the job (`dtrain run`
    does this itself in the one-per-node form)."""
    from dtrain.comm import slurm

    received = getattr(stop, "received", None)
    line = slurm.requeue_after_stop(run_dir, os.environ, received.name if received is not None else None,
                                    getattr(stop, "received_at", None))
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def _search_advisor(run_dir: Path) -> Any:
    """The searcher's stop advisor when this run is a trial of a search (its run dir holds search-trial.json)."""
    from dtrain.search.link import LinkAdvisor, SearchLink

    link = SearchLink.from_run_dir(run_dir)
    return LinkAdvisor(link) if link is not None else None


def _lost_a_peer(exc: BaseException) -> bool:
    """True for the errors gloo and the store raise when another worker process has died."""
    from dtrain.comm.failures import Failure, classify_failure  # torch is imported only once a worker runs

    return classify_failure(exc) is Failure.LOST_PEER


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


@dataclass
class _Progress:
    """The running Trainer, if any: how far training got when an exception was raised."""

    trainer: Any = None
    in_user_code: bool = False  # the worker failed with a user error or an exception in user code

    def batches_done(self) -> int | None:
        state = getattr(self.trainer, "state", None)
        return getattr(state, "steps_completed", None)


def _attempt() -> int:
    """This worker's attempt: the elastic agent's restart count (0 when no agent started it)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def _peer_gone(run_dir: Path | None, exc: BaseException) -> int:
    """Another worker died and a collective noticed: say so (unless that worker recorded why), and exit FAILED so
    that the launcher restarts everyone from the latest checkpoint."""
    logging.getLogger("dtrain").error("a collective failed: another worker is gone", exc_info=True,
                                      extra={"console": False})
    explained = run_dir is not None and (read_fatal(run_dir) is not None or recorded(run_dir, launch_id(), _attempt()))
    if not explained:
        print(f"dtrain: rank {os.environ.get('RANK', '?')}: another worker is gone ({_first_line(exc)}); "
              "stopping so that the workers can be restarted from the latest checkpoint", file=sys.stderr, flush=True)
    return ExitCode.FAILED


def _user_exception(run_dir: Path | None, exc: Exception, batches_done: int | None) -> int:
    """An exception in user code (or in dtrain: a bug): its whole traceback goes to the rank's log, and a record
    of it to the run dir. The first time it exits FAILED, so that the launcher restarts the workers; when the
    attempt before met the same exception at the same batch, a restart cannot help: it is recorded as the run's
    fatal error (exit code 2) with the user's frames of its traceback."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    rank = _rank()
    found = describe_exception(exc, rank=rank, attempt=_attempt(), batches_done=batches_done)
    get_error_handler().record_exception(exc)  # torch's error file, as an uncaught exception would write it
    if run_dir is None or not run_dir.is_dir():
        traceback.print_exception(exc)
        return ExitCode.FAILED
    log = run_dir / "logs" / f"rank-{rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        handle.write(f"exception in attempt {found.attempt}: {found.describe()}\n"
                     + "".join(traceback.format_exception(exc)))
    earlier = record_exception(run_dir, found)
    if earlier is not None:
        write_fatal(run_dir, f"{found.describe()}, again after a restart from the latest checkpoint: restarting "
                    f"cannot get past it; fix the code (full traceback: {log})", rank, ExitCode.USER_ERROR,
                    traceback=found.traceback)
    if "DTRAIN_LAUNCHER" not in os.environ:  # plain torchrun or srun: the traceback, as Python would print it
        traceback.print_exception(exc)
    return ExitCode.USER_ERROR if earlier is not None else ExitCode.FAILED


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split("] ", 1)[-1][:160]


def _serve(run_dir: Path, config: Any, topology: Any, config_dir: Path, spec: StrategySpec) -> int:
    """A server process beside the workers (a parameter server): serve them until they leave. The Trial's module
    is imported first, so that an optimizer class defined there can be built on the server."""
    from dtrain.determined.entrypoint import load_trial

    assert spec.serve is not None, f"strategy {spec.name} counts servers but has no `serve`"
    load_trial(config, config_dir)
    # the log goes into the run dir once the workers are in the RPC group: by then rank 0 has prepared the dir
    name = f"server-{topology.rank - topology.world_size}"
    spec.serve(topology, config, lambda: _setup_logging(run_dir, topology.rank, name=name))
    return ExitCode.OK


def main(argv: list[str] | None = None, *, quick_exit: bool = False) -> int:
    """Run one worker and return its exit code; with `quick_exit` (a worker process of its own) the worker
    leaves through `os._exit` once its work is flushed: tearing down the interpreter with torch in it takes
    seconds on a busy host, which the agent would wait for, and can deadlock in gloo's destructor."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.run_dir is None and (args.config is None or "SLURM_JOB_ID" not in os.environ):
        parser.error("--run-dir is required (outside a Slurm job, or without CONFIG)")
    earlier = read_fatal(args.run_dir) if args.run_dir is not None else None
    if earlier is not None:  # a restart after a user error: fail fast, the error will not go away
        code = earlier.get("exit_code")
        return code if isinstance(code, int) else ExitCode.USER_ERROR
    from torch.distributed.elastic.multiprocessing.errors import record

    progress = _Progress()

    @record
    def guarded() -> int:
        try:
            return run_worker(args, progress)
        except KeyboardInterrupt:  # Ctrl-C or the agent stopping us: the launcher reports it, no traceback
            logging.getLogger("dtrain").warning("interrupted", extra={"console": False})
            return ExitCode.INTERRUPTED
        except StallError as exc:
            # a rank stopped answering: like a lost worker, a restart from the latest checkpoint may get past it
            logging.getLogger("dtrain").error("%s", exc, extra={"console": False})
            print(f"dtrain: {exc}; stopping so that the workers can be restarted from the latest checkpoint",
                  file=sys.stderr, flush=True)
            return ExitCode.FAILED
        except DtrainError as exc:
            progress.in_user_code = True
            rank = _rank()
            if logging.getLogger().handlers:  # not before the log is set up: logging's last resort would print it
                logging.getLogger("dtrain").error("%s", exc, extra={"console": False})
            if args.run_dir is not None and args.run_dir.is_dir():
                write_fatal(args.run_dir, str(exc), rank, exc.exit_code)
            if "DTRAIN_LAUNCHER" not in os.environ:  # `dtrain run` prints it from fatal-error.json itself
                print(f"dtrain: error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        except Exception as exc:
            if _lost_a_peer(exc):  # a worker died (crash, kill, lost node) and a collective noticed
                return _peer_gone(args.run_dir, exc)
            progress.in_user_code = True
            return _user_exception(args.run_dir, exc, progress.batches_done())

    code = int(guarded() or ExitCode.OK)
    if quick_exit:
        gc.disable()  # no collection may free the DDP reducer (and its gloo group) before os._exit below
    from dtrain.comm import shutdown_distributed

    shutdown_distributed()
    if quick_exit:
        # A worker process of its own leaves without tearing the interpreter down, whatever its code: freeing a
        # DDP reducer there destroys its gloo group, whose destructor joins gloo's worker thread while holding
        # the GIL that thread may need to free a finished collective's tensors (a deadlock seen in CI: a worker
        # that had written its last checkpoint hung at exit until its launcher gave up).
        atexit._run_exitfuncs()  # what a normal exit runs first (the metrics writer's drain among them)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main(quick_exit=True))
