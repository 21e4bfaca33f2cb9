"""`dtrain run CONFIG`: train an experiment with one worker process per slot, and say how it ended."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError, ExitCode, LaunchError

DESCRIPTION = ("Train the experiment a YAML file describes, with one worker process per slot "
               f"(resources.slots_per_trial). Exit code {ExitCode.OK} only when training finished; {ExitCode.FAILED} "
               f"when workers failed; {ExitCode.USER_ERROR} for a config, data, checkpoint or Trial error or a "
               f"diverged run; {ExitCode.STOPPED} when stopped early (resumable; a search's trial stopped by its "
               f"searcher too); {ExitCode.INVALID_HP} when the Trial rejected its hyperparameters (InvalidHP); "
               f"{ExitCode.INTERRUPTED} when interrupted (Ctrl-C, SIGTERM or SIGUSR1: the workers checkpoint after the "
               "batch they are on; resumable).")


def register(subcommands: Any) -> argparse.ArgumentParser:
    """Add `dtrain run` and its options."""
    run = subcommands.add_parser(
        "run", help="train an experiment", description=DESCRIPTION,
        epilog="Across machines run the same command on every node with --nnodes, --node-rank and the chief's "
        "--master-addr/--master-port, or with --nnodes and --rdzv-endpoint where `dtrain rendezvous` serves the store "
        "(then any node may be lost, node 0 included: give every node the same --run-dir on a shared file system). "
        "Running it again with the same --run-dir resumes an unfinished run.")
    run.add_argument("config", type=Path, help="experiment YAML file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set resources.slots_per_trial=4 (repeatable; the value "
                          "is read as YAML)")
    run.add_argument("--run-dir", type=Path, help="where the run's files go (default: runs/<name>/<id>/, in a Slurm "
                     "job step runs/<name>/slurm-<job id>[-node<N>]/); an existing unfinished run there is resumed")
    run.add_argument("--nnodes", metavar="N|MIN:MAX",
                     help="machines in the job (default 1, or PET_NNODES in a PyTorchJob, SLURM_NNODES in a Slurm job "
                          "step); MIN:MAX keeps training while nodes leave and join: each node runs slots_per_trial / "
                          "MAX workers, and the job re-forms from the latest checkpoint at each change "
                          "(docs/clusters.md, Elastic membership)")
    run.add_argument("--node-rank", type=int, help="this machine's index, 0 on the chief (default 0, or "
                                                     "PET_NODE_RANK, or SLURM_NODEID)")
    run.add_argument("--master-addr",
                     help="the chief's address; the rendezvous listens on loopback unless this is given "
                          "(default 127.0.0.1, or PET_MASTER_ADDR, or the first host of a Slurm job step)")
    run.add_argument("--master-port", type=int, help="the chief's rendezvous port (default: a free port; in a "
                     "Slurm job step MASTER_PORT, else 20000 + the job id mod 20000)")
    run.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                     help="the c10d rendezvous store shared by all nodes, instead of --node-rank/--master-*: "
                          "where `dtrain rendezvous` serves it on a host that outlives the nodes (every node a "
                          "client: any node may be lost, node 0 included), else hosted by the node whose address "
                          "it names (that node must stay); nothing serving it within 60 s is an error")
    run.add_argument("--network-interface", metavar="NAME",
                     help="this machine's network interface to the other nodes, for gloo (default: "
                          "distributed.network_interface, else the one that routes to --master-addr)")
    run.add_argument("--rdzv-id", help="job id for the c10d rendezvous (default: dtrain-<name>)")
    run.add_argument("--slots", type=int, help="a search (searcher random, grid, adaptive_asha or optuna): the slots "
                     "this machine gives its trials (default: its cores); trials run side by side as the slots allow")
    run.add_argument("--search-dir", type=Path, help="a search: where the study and the trials' run dirs go "
                     "(default: runs/<name>-search/); the same dir resumes a stopped search")
    run.add_argument("--storage", metavar="URL", help="a search: the Optuna study's RDB storage, e.g. "
                     "sqlite:////shared/study.db or postgresql://user:pass@host/db; `dtrain run` on several machines "
                     "with the same URL share one study, each running the trials it draws (default: sqlite "
                     "study.db in the search dir)")
    run.add_argument("--study", metavar="NAME", help="a search: the study's name in the storage (default: the "
                     "experiment's name)")
    run.add_argument("--experiment-id", type=int, help="register the run as a trial of this experiment in the run "
                     "store instead of a new experiment (a search gives its trials its experiment)")
    run.set_defaults(handler=run_experiment)
    return run


def run_experiment(args: argparse.Namespace) -> int:
    """Check everything that can be checked before a worker starts, launch the workers, record how they ended."""
    # imported here, not above: `dtrain --help` stays quick, and tests can replace `launch_workers`
    from dtrain.comm import check_devices
    from dtrain.config import check_buildable, load_config
    from dtrain.determined.command import check_command
    from dtrain.determined.entrypoint import load_trial
    from dtrain.determined.experiment import single_searcher_draw
    from dtrain.launch import NodeSpec, check_elastic_range, launch_workers
    from dtrain.runs.rundir import SUMMARY_FILE, prepare_run_dir, read_summary, write_json_atomic
    from dtrain.runs.storage import prepare_storage
    from dtrain.runs.store import RunStore
    from dtrain.search.runner import is_search, raw_config
    from dtrain.train.resize import check_resume
    from dtrain.train.tracking import check_tracking

    _parse_node_range(args, os.environ)
    _check_rendezvous_options(args)
    raw = raw_config(args.config, args.overrides)
    if is_search(raw):
        return _run_search(args)
    drawn = single_searcher_draw(raw)
    if drawn:  # Determined's single searcher over ranges trains one trial with values drawn from them
        print("dtrain: searcher single over hyperparameter ranges: drew " + ", ".join(
            d.removeprefix("hyperparameters.") for d in drawn) + " (reproducibility.experiment_seed)", file=sys.stderr)
        args.overrides = [*args.overrides, *drawn]
    if args.min_nodes is not None and args.min_nodes < args.nnodes and "min_checkpoint_period" not in raw:
        every = int(raw.get("scheduling_unit") or 100)  # each training report: a lost node costs at most this many
        args.overrides = [*args.overrides, f"min_checkpoint_period={{batches: {every}}}"]
        print(f"dtrain: --nnodes {args.min_nodes}:{args.nnodes}: a checkpoint every {every} batches (scheduling_unit; "
              "min_checkpoint_period was not set), so that a lost node costs at most that many batches",
              file=sys.stderr)
    if any(value is not None for value in (args.slots, args.search_dir, args.storage, args.study)):
        raise ConfigError("--slots, --search-dir, --storage and --study are for a search (searcher random, grid, "
                          "adaptive_asha or optuna); this experiment's searcher is single: drop them")
    loaded = load_config(args.config, args.overrides)
    config = loaded.config
    check_buildable(config)
    _node_options_from_slurm(args, os.environ, config.name)
    check_devices(config.distributed.backend, config.distributed.device)  # a GPU asked for where none is
    _node_options_from_environment(args, os.environ)
    node = NodeSpec(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                    master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                    network_interface=args.network_interface, min_nodes=args.min_nodes)
    node.validate(config.resources.world_size)
    check_elastic_range(config, node)
    if node.nnodes > 1 and node.node_rank != 0 and node.rdzv_endpoint is None and node.network_interface is None:
        from dtrain.comm.topology import check_master_reachable

        assert node.master_port is not None  # validate() asks for it on several nodes
        check_master_reachable(node.master_addr, node.master_port, config.distributed.timeout_seconds)
    if node.rdzv_endpoint is not None:  # nothing serves it and this node would not host it: one line, not a hang
        from dtrain.comm.rendezvous_store import SERVED_WAIT_SECONDS, check_endpoint

        check_endpoint(node.rdzv_endpoint, min(SERVED_WAIT_SECONDS, config.distributed.timeout_seconds))
    if config.is_command:  # a command that cannot start fails here, before any worker starts
        check_command(config.entry.argv, loaded.base_dir)
    else:  # so do a wrong Trial class and hyperparameters it cannot use
        load_trial(config, loaded.base_dir).check_hyperparameters(config.hyperparameters)
    prepare_storage(config.checkpoint_storage)  # a missing library, endpoint, bucket or key: one line, now
    check_resume(config, args.run_dir)  # a run dir written at another size: can it go on at this one?
    check_tracking(config.tracking)  # tracking.mlflow without the mlflow package or a URI: one line, now
    for warning in loaded.warnings:
        print(f"dtrain: warning: {warning}", file=sys.stderr)
    info = prepare_run_dir(config, args.run_dir, loaded.base_dir, register=node.node_rank == 0,
                           experiment_id=args.experiment_id)
    print(f"dtrain: run dir {info.run_dir}" + (" (resuming)" if info.resumed else ""), file=sys.stderr)
    started = time.time()
    result = launch_workers(info.run_dir, config, node)
    if result.exit_code == ExitCode.INTERRUPTED and node.node_rank == 0:
        _requeue_if_preempted(info.run_dir, os.environ, result.signal)
    summary = read_summary(info.run_dir) or {}
    if result.exit_code != ExitCode.OK:
        if result.traceback:  # an exception in user code: its user frames, once, above the one line
            print(result.traceback, file=sys.stderr)
        print(f"dtrain: error: {result.message}", file=sys.stderr)
        status = {ExitCode.INTERRUPTED: "interrupted", ExitCode.INVALID_HP: "invalid"}.get(result.exit_code, "failed")
        summary = {**summary, "status": status, "error": result.message}
        if node.node_rank == 0:
            write_json_atomic(info.run_dir / SUMMARY_FILE, summary)
            if info.store is not None and info.trial_id is not None:
                store = RunStore(info.store)
                store.set_status(info.trial_id, status, summary)
                store.close()
        passed_on = (ExitCode.USER_ERROR, ExitCode.INVALID_HP, ExitCode.INTERRUPTED)
        return result.exit_code if result.exit_code in passed_on else ExitCode.FAILED
    if node.node_rank != 0 or not result.chief:  # the chief's run dir holds the summary
        return ExitCode.OK
    if config.is_command:
        summary = _command_summary(info, summary, started, config.resources.world_size)
    _print_summary(info.run_dir, info.experiment_id, summary, time.time() - started)
    return ExitCode.OK if summary.get("status") == "completed" else ExitCode.STOPPED


def _parse_node_range(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """`--nnodes N` or `MIN:MAX` into `args.nnodes` (N or MAX) and `args.min_nodes` (MIN, or None); a bad value is
    one line before anything starts. Without --nnodes, an elastic PyTorchJob's `PET_NNODES=MIN:MAX` (MIN < MAX) is
    the range, as if given on the command line."""
    from dtrain.launch import parse_nnodes

    args.min_nodes = None
    pet_nnodes = environ.get("PET_NNODES", "")
    low, colon, high = pet_nnodes.partition(":")
    if args.nnodes is None and colon and low.strip() != high.strip():
        try:
            args.nnodes, args.min_nodes = parse_nnodes(pet_nnodes)
        except LaunchError as error:
            raise ConfigError(f"environment variable PET_NNODES={pet_nnodes!r} (an elastic PyTorchJob's "
                              f"minReplicas:maxReplicas) read as --nnodes: {error}") from None
    if isinstance(args.nnodes, str):
        args.nnodes, args.min_nodes = parse_nnodes(args.nnodes)


def _check_rendezvous_options(args: argparse.Namespace) -> None:
    """--rdzv-endpoint numbers the nodes itself and has no master: given with --node-rank, --master-addr or
    --master-port it is one line (which of the two ways to start did the user mean?)."""
    from dtrain.comm.rendezvous_store import parse_endpoint

    if args.rdzv_endpoint is None:
        return
    parse_endpoint(args.rdzv_endpoint)
    given = [flag for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                                      ("--master-port", args.master_port)) if value is not None]
    if given:
        raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint} with {', '.join(given)}: under --rdzv-endpoint "
                          "the rendezvous numbers the nodes and picks the chief, so there is no node rank or master "
                          f"to give; drop {', '.join(given)} (or drop --rdzv-endpoint and give every node its "
                          "--node-rank and the chief's --master-addr/--master-port)")


def _node_options_from_slurm(args: argparse.Namespace, environ: Mapping[str, str], name: str) -> None:
    """In a Slurm job step (`srun dtrain run ...`, one task per node) fill what was not given from the job: --nnodes
    from SLURM_NNODES, --node-rank from SLURM_NODEID, --master-addr from an exported MASTER_ADDR or the first host of
    the node list, --master-port from MASTER_PORT or the job id, and the run dir from the job id (a requeued job
    resumes there). A step with several tasks per node, or an --nnodes that disagrees with the job's, is one line
    naming the fix."""
    from dtrain.comm import slurm
    from dtrain.runs.rundir import slurm_run_dir

    if not slurm.in_job_step(environ):
        return
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or "1")
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or str(nodes))
    if tasks != nodes:
        raise ConfigError(f"`dtrain run` runs under srun with {tasks} tasks on {nodes} node(s), but it starts its "
                          "node's workers itself: start one per node (srun --ntasks-per-node=1), or one "
                          "`python -m dtrain.worker` per slot without `dtrain run` (docs/clusters.md, Slurm)")
    if args.nnodes is not None and args.nnodes != nodes:
        raise ConfigError(f"--nnodes {args.nnodes} disagrees with this Slurm job step's SLURM_NNODES={nodes}: drop "
                          f"--nnodes (dtrain run takes it from Slurm), or submit the job with --nodes={args.nnodes}")
    if args.rdzv_endpoint is not None:
        return
    if args.nnodes is None:
        args.nnodes = nodes
    if args.node_rank is None:
        args.node_rank = int(environ.get("SLURM_NODEID", "0"))
    if args.master_addr is None and nodes > 1:
        args.master_addr = environ.get("MASTER_ADDR") or slurm.first_host(environ)
    if args.master_port is None and nodes > 1:
        args.master_port = slurm.master_port(environ)
    if args.run_dir is None:
        args.run_dir = slurm_run_dir(name, environ["SLURM_JOB_ID"], args.node_rank)


def _requeue_if_preempted(run_dir: Path, environ: Mapping[str, str], signal_name: str | None) -> None:
    """In a Slurm job that was preempted or sent SIGUSR1 (its workers stopped with a checkpoint), requeue the job:
    it starts again with the same id, so in the same run dir, and resumes from that checkpoint."""
    from dtrain.comm import slurm
    from dtrain.runs.rundir import read_summary

    stopped = (read_summary(run_dir) or {}).get("stop_signal") or {}
    line = slurm.requeue_after_stop(run_dir, environ, stopped.get("name") or signal_name, stopped.get("received_at"))
    if line is not None:
        print(line, file=sys.stderr)


# Kubeflow sets these in every pod for torchrun; `dtrain run` reads them too. A v1 PyTorchJob (training-operator)
# sets PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE and, with a Master replica, MASTER_ADDR and MASTER_PORT (with an
# elasticPolicy PET_RDZV_ENDPOINT, PET_RDZV_BACKEND and PET_NNODES as MIN:MAX); a v2 TrainJob PET_MASTER_ADDR and
# PET_MASTER_PORT.
PET_VARIABLES = {"PET_NNODES": ("nnodes", 1, int), "PET_NODE_RANK": ("node_rank", 0, int),
                 "PET_MASTER_ADDR": ("master_addr", "127.0.0.1", str), "PET_MASTER_PORT": ("master_port", None, int),
                 "PET_RDZV_ENDPOINT": ("rdzv_endpoint", None, str)}
V1_MASTER_VARIABLES = {"PET_MASTER_ADDR": "MASTER_ADDR", "PET_MASTER_PORT": "MASTER_PORT"}


def _pet_nnodes(raw: str) -> str:
    """PET_NNODES as one number: an elastic PyTorchJob's MIN:MAX gives MAX (the range itself is read by
    `_parse_node_range`, before the config is loaded, as `--nnodes MIN:MAX`)."""
    low, _, high = raw.partition(":")
    return high or low


def _node_options_from_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill --nnodes, --node-rank, --master-addr, --master-port and --rdzv-endpoint from the variables of a Kubeflow
    PyTorchJob or TrainJob where the option was not given (an option on the command line wins), then the defaults."""
    env = dict(environ)
    if "PET_NNODES" in env:  # in a PyTorchJob's pod: v1 names the master without PET_
        for pet, plain in V1_MASTER_VARIABLES.items():
            if pet not in env and plain in env:
                env[pet] = env[plain]
        env["PET_NNODES"] = _pet_nnodes(env["PET_NNODES"])
    for variable, (dest, default, kind) in PET_VARIABLES.items():
        raw = env.get(variable)
        if getattr(args, dest) is not None:
            continue
        setattr(args, dest, default)
        if raw is None:
            continue
        if variable == "PET_RDZV_ENDPOINT" and env.get("PET_RDZV_BACKEND", "c10d") == "static":
            continue  # the static backend is the master address and port, read above
        try:
            setattr(args, dest, kind(raw))
        except ValueError:
            raise ConfigError(f"environment variable {variable}={raw!r} (set by the PyTorchJob) must be "
                              f"{'an integer' if kind is int else 'text'}") from None


def _command_summary(info: Any, summary: dict[str, Any], started: float, world_size: int) -> dict[str, Any]:
    """The summary of a command that ended with exit code 0: the one `det.core` wrote during this launch, or (a
    script that does not use Determined's APIs) a `completed` one written here, in the run dir and the store."""
    from dtrain.runs.rundir import SUMMARY_FILE, write_json_atomic
    from dtrain.runs.store import RunStore

    path = info.run_dir / SUMMARY_FILE
    if summary and path.is_file() and path.stat().st_mtime >= started:
        return summary
    summary = {"status": "completed", "entrypoint": "command", "world_size": world_size,
               "steps_completed": 0, "wall_seconds": time.time() - started, "validation": {}}
    write_json_atomic(path, summary)
    if info.store is not None and info.trial_id is not None:
        store = RunStore(info.store)
        store.set_status(info.trial_id, "completed", summary)
        store.close()
    return summary


def _run_search(args: argparse.Namespace) -> int:
    """`dtrain run` of a search: its trials, each an ordinary run, on this machine's slots (docs/search.md)."""

    from dtrain.runs.processes import host_cores
    from dtrain.runs.rundir import runs_root
    from dtrain.search.runner import SearchRunner, raw_config

    if args.nnodes not in (None, 1) or args.rdzv_endpoint or args.run_dir or args.experiment_id is not None:
        raise ConfigError("a search runs each trial on this machine with its own run dir: drop --nnodes, "
                          "--rdzv-endpoint, --run-dir and --experiment-id (use --search-dir for where the trials go, "
                          "--storage to share the study with other machines)")
    raw = raw_config(args.config, args.overrides)
    slots = args.slots or host_cores()
    if slots < 1:
        raise ConfigError(f"--slots {slots}: at least 1")
    name = str(raw.get("name") or Path(args.config).stem)
    search_dir = args.search_dir or runs_root() / f"{name}-search"
    overrides = [o for o in args.overrides if not o.startswith("searcher")]
    runner = SearchRunner(Path(args.config), overrides, raw, search_dir, slots,
                          seed=int((raw.get("reproducibility") or {}).get("experiment_seed", 0)),
                          storage=args.storage, study_name=args.study or name)
    print(f"dtrain search: {runner.spec.name} search of {runner.total} trials, up to {runner.parallel} at once here; "
          f"search dir {search_dir}; study {runner.study_name!r} in {runner.storage}", flush=True)
    return runner.run()


def _print_summary(run_dir: Path, experiment_id: int | None, summary: dict[str, Any], launch_seconds: float) -> None:
    status = summary.get("status", "unknown")
    validation = summary.get("validation") or {}
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in sorted(validation.items()))
    if str(summary.get("entrypoint", "")).startswith("command"):  # a Core API script counts its own steps
        first = (f"dtrain: training {status}: the script reported {summary.get('steps_completed', 0)} steps on "
                 f"{summary.get('world_size', '?')} worker(s), {summary.get('wall_seconds', 0):.0f} s "
                 f"({launch_seconds:.0f} s in all)")
    elif summary.get("svm") or summary.get("epochs_completed", 0) is None:  # an SMO solve has no epochs
        svm = summary.get("svm") or {}
        solved = (f" ({svm['iterations']:,} SMO iterations on {svm['n_samples']:,} samples, {svm['n_support']:,} "
                  "support vectors)") if svm else ""
        first = (f"dtrain: training {status}: {summary.get('steps_completed', 0)} batches of "
                 f"{summary.get('global_batch_size', '?')} SMO iterations{solved} on {summary.get('world_size', '?')} "
                 f"worker(s), {summary.get('wall_seconds', 0):.0f} s of training ({launch_seconds:.0f} s in all)")
    else:
        first = (f"dtrain: training {status}: {summary.get('steps_completed', 0)} batches "
                 f"({summary.get('epochs_completed', 0):.2f} epochs) on {summary.get('world_size', '?')} worker(s), "
                 f"{summary.get('wall_seconds', 0):.0f} s of training ({launch_seconds:.0f} s in all), "
                 f"{summary.get('samples_per_second', 0):,.0f} samples/s")
    lines = [
        first,
        f"  validation   {metrics or 'none'}",
        f"  run dir      {run_dir}",
        f"  checkpoint   {_describe_checkpoint(run_dir, summary.get('checkpoint'))}",
        f"  TensorBoard  tensorboard --logdir {run_dir / 'tensorboard'}",
    ]
    if summary.get("world_size", 1) > 1 and summary.get("strategy"):
        lines.insert(2, f"  sync         {_describe_sync(summary['strategy'])}")
        wire = summary.get("communication") or {}
        if wire.get("communicating_steps"):
            ratio = wire.get("compression_ratio") or 1.0
            steps, sent = summary.get("steps_completed", 0), wire["communicating_steps"]
            per = ("update" if sent >= steps else  # e.g. local SGD's averaging rounds, accumulated gradients
                   f"update that communicated ({sent:,} of {steps:,} batches)")
            lines.insert(3, f"  wire         {wire['compression']}: {wire['bytes_per_step'] / 1e6:,.3f} MB sent per "
                            f"{per} by each worker ({ratio:.3g}x less than dense fp32), "
                            f"{wire['total_bytes'] / 1e9:,.3f} GB in all")
    if summary.get("preemptions"):
        from dtrain.runs.preemptions import describe_preemptions

        lines.append(f"  preempted    {describe_preemptions(summary['preemptions'])}")
    precision = summary.get("precision") or {}
    if precision.get("autocast_dtype"):
        left = precision.get("modules_in_fp32") or []
        lines.insert(2, f"  precision    {precision['name']}: autocast to {precision['autocast_dtype']}"
                        + (f"; left in fp32 by autocast: {', '.join(left[:6])}" + (" ..." if len(left) > 6 else "")
                           if left else ""))
    if experiment_id is not None:
        lines.append(f"  store        dtrain experiments show {experiment_id}")
    from dtrain.train.tracking import mlflow_run_link

    mlflow = mlflow_run_link(run_dir)
    if mlflow is not None:
        lines.append(f"  MLflow       {mlflow}")
    if status == "stopped":
        lines.append("  resume with the same command and --run-dir " + str(run_dir))
    print("\n".join(lines))


def _describe_checkpoint(run_dir: Path, model_file: str | None) -> str:
    """The last checkpoint's model.pt, or, when the run wrote its weights as shards (fsdp, pipeline), how to get a
    plain one."""
    from dtrain.runs.rundir import load_run_info
    from dtrain.runs.storage import with_secrets
    from dtrain.train.checkpoint import SHARDED_DIR

    if model_file is None:
        return "none"
    step_dir = model_file.rsplit("/", 1)[0]
    step = step_dir.rsplit("/", 1)[-1]
    store = with_secrets(load_run_info(run_dir).checkpoints)
    if store.exists(f"{SHARDED_DIR}/{step}"):
        return f"{step_dir} (weights in shards: `dtrain export {run_dir}` writes a plain model.pt)"
    return model_file


def _describe_sync(strategy: dict[str, Any]) -> str:
    """The strategy's line, as its registered spec writes it from its `describe()`: `allreduce, op average,
    buckets 1.6 MB (auto-tuned, median step ms: 0.4 MB 79, 1.6 MB 71)`."""
    from dtrain.sync import REGISTRY
    from dtrain.sync.spec import data_parallel_summary

    spec = REGISTRY.get(str(strategy.get("name")))
    return (spec.summary if spec is not None else data_parallel_summary)(strategy)

