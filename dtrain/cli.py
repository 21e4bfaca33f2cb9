"""The `dtrain` command: run an experiment, list or show the runs in the store, plan a cluster.

Errors the user can fix are printed as one line (`dtrain: error: ...`) with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dtrain import __version__
from dtrain.errors import DtrainError

EXIT_FAILED, EXIT_USER_ERROR, EXIT_STOPPED, EXIT_INTERRUPTED = 1, 2, 3, 130
_SUBPARSERS: dict[str, argparse.ArgumentParser] = {}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in our one-line style with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USER_ERROR, f"dtrain: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dtrain", description="Distributed training of PyTorch models on torch.distributed.",
                     epilog="Start with `dtrain run examples/fashion_mnist/distributed.yaml`.")
    parser.add_argument("--version", action="version", version=f"dtrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = commands.add_parser(
        "run", help="train an experiment", description="Train the experiment a YAML file describes, with one "
        "worker process per slot (resources.slots_per_trial). Exit code 0 only when training finished; 1 when "
        "workers failed; 2 for a config, data, checkpoint or Trial error or a diverged run; 3 when stopped early "
        "(resumable); 130 when interrupted (Ctrl-C or SIGTERM: the workers checkpoint after the batch they are on; "
        "resumable).",
        epilog="Across machines run the same command on every node with --nnodes, --node-rank and the chief's "
        "--master-addr/--master-port. Running it again with the same --run-dir resumes an unfinished run.")
    run.add_argument("config", type=Path, help="experiment YAML file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set resources.slots_per_trial=4 (repeatable; the value "
                          "is read as YAML)")
    run.add_argument("--run-dir", type=Path, help="where the run's files go (default: runs/<name>/<id>/); an "
                                                 "existing unfinished run there is resumed")
    run.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    run.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 on the chief")
    run.add_argument("--master-addr", default="127.0.0.1",
                     help="the chief's address; the rendezvous listens on loopback unless this is given "
                          "(default 127.0.0.1)")
    run.add_argument("--master-port", type=int, help="the chief's rendezvous port (default: a free port)")
    run.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                     help="c10d rendezvous endpoint shared by all nodes, instead of --node-rank/--master-*")
    run.add_argument("--rdzv-id", help="job id for the c10d rendezvous (default: dtrain-<name>)")
    run.set_defaults(handler=_cmd_run)

    experiments = commands.add_parser("experiments", help="list or show runs recorded in the store",
                                      description="Read the run store (runs/metrics.db, or "
                                                  "$DTRAIN_RUNS_ROOT/metrics.db).")
    which = experiments.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    listing = which.add_parser("list", help="one line per experiment")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(handler=_cmd_experiments_list)
    show = which.add_parser("show", help="config, status, summary and metrics of one experiment")
    show.add_argument("id", type=int, help="experiment id (first column of `dtrain experiments list`)")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(handler=_cmd_experiments_show)

    from dtrain.plan.command import add_plan_parser

    plan = add_plan_parser(commands)
    from dtrain.profile.command import add_diagnose_parser

    diagnose = add_diagnose_parser(commands)
    _SUBPARSERS.update(run=run, experiments=experiments, plan=plan, diagnose=diagnose)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        helper = parser if args.command is None else _SUBPARSERS[args.command]
        helper.print_help()
        return EXIT_USER_ERROR
    try:
        return int(handler(args))
    except DtrainError as exc:
        print(f"dtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dtrain: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# ----------------------------------------------------------------------------------------------- run


def _cmd_run(args: argparse.Namespace) -> int:
    from dtrain.config import check_buildable, load_config
    from dtrain.launch import NodeSpec, launch_workers
    from dtrain.train.entrypoint import load_trial_class
    from dtrain.train.rundir import prepare_run_dir, read_summary
    from dtrain.train.store import RunStore

    loaded = load_config(args.config, args.overrides)
    config = loaded.config
    check_buildable(config)
    node = NodeSpec(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                    master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    node.validate(config.resources.world_size)
    load_trial_class(config.entrypoint, loaded.base_dir)  # a wrong entrypoint fails here, before any worker starts
    for warning in loaded.warnings:
        print(f"dtrain: warning: {warning}", file=sys.stderr)
    info = prepare_run_dir(config, args.run_dir, loaded.base_dir, register=node.node_rank == 0)
    print(f"dtrain: run dir {info.run_dir}" + (" (resuming)" if info.resumed else ""), file=sys.stderr)
    started = time.time()
    result = launch_workers(info.run_dir, config, node)
    summary = read_summary(info.run_dir) or {}
    if result.exit_code != 0:
        print(f"dtrain: error: {result.message}", file=sys.stderr)
        status = "interrupted" if result.exit_code == EXIT_INTERRUPTED else "failed"
        summary = {**summary, "status": status, "error": result.message}
        if node.node_rank == 0:
            from dtrain.train.rundir import SUMMARY_FILE, write_json_atomic

            write_json_atomic(info.run_dir / SUMMARY_FILE, summary)
            if info.store is not None and info.trial_id is not None:
                store = RunStore(info.store)
                store.set_status(info.trial_id, status, summary)
                store.close()
        return result.exit_code if result.exit_code in (EXIT_USER_ERROR, EXIT_INTERRUPTED) else EXIT_FAILED
    if node.node_rank != 0:
        return 0
    _print_summary(info.run_dir, info.experiment_id, summary, time.time() - started)
    return 0 if summary.get("status") == "completed" else EXIT_STOPPED


def _print_summary(run_dir: Path, experiment_id: int | None, summary: dict[str, Any], launch_seconds: float) -> None:
    status = summary.get("status", "unknown")
    validation = summary.get("validation") or {}
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in sorted(validation.items()))
    lines = [
        f"dtrain: training {status}: {summary.get('steps_completed', 0)} batches "
        f"({summary.get('epochs_completed', 0):.2f} epochs) on {summary.get('world_size', '?')} worker(s), "
        f"{summary.get('wall_seconds', 0):.0f} s of training ({launch_seconds:.0f} s in all), "
        f"{summary.get('samples_per_second', 0):,.0f} samples/s",
        f"  validation   {metrics or 'none'}",
        f"  run dir      {run_dir}",
        f"  checkpoint   {summary.get('checkpoint')}",
        f"  TensorBoard  tensorboard --logdir {run_dir / 'tensorboard'}",
    ]
    if summary.get("world_size", 1) > 1 and summary.get("strategy"):
        lines.insert(2, f"  sync         {_describe_sync(summary['strategy'])}")
        wire = summary.get("communication") or {}
        if wire.get("communicating_steps"):
            ratio = wire.get("compression_ratio") or 1.0
            lines.insert(3, f"  wire         {wire['compression']}: {wire['bytes_per_step'] / 1e6:,.3f} MB sent per "
                            f"update by each worker ({ratio:.3g}x less than dense fp32), "
                            f"{wire['total_bytes'] / 1e9:,.3f} GB in all")
    if experiment_id is not None:
        lines.append(f"  store        dtrain experiments show {experiment_id}")
    if status == "stopped":
        lines.append("  resume with the same command and --run-dir " + str(run_dir))
    print("\n".join(lines))


def _describe_sync(strategy: dict[str, Any]) -> str:
    """`allreduce, op average, buckets 1.6 MB (auto-tuned: 0.4 MB 79 ms/step, 1.6 MB 71 ms/step)`."""
    if strategy.get("name") == "parameter_server":
        text = (f"parameter_server, {strategy.get('servers')} server(s), mode {strategy.get('mode')}, staleness mean "
                f"{strategy.get('staleness_mean', 0.0):.2f} max {strategy.get('staleness_max', 0)}, dropped gradients "
                f"{strategy.get('dropped_gradients', 0)}")
        return text
    text = f"{strategy.get('name')}, op {strategy.get('op')}"
    if "bucket_cap_mb" in strategy:
        text += f", buckets {strategy['bucket_cap_mb']:.3g} MB"
    visits = (strategy.get("fusion_tuning") or {}).get("visits") or []
    if visits:
        times: dict[float, list[float]] = {}
        for size, seconds in visits:
            times.setdefault(size, []).append(seconds)
        shown = ", ".join(f"{size:.3g} MB {sum(t) / len(t) * 1e3:.0f}" for size, t in sorted(times.items()))
        text += f" (auto-tuned, median step ms: {shown})"
    return text


# --------------------------------------------------------------------------------------- experiments


def _open_store() -> Any:
    from dtrain.errors import LaunchError
    from dtrain.train.rundir import store_path
    from dtrain.train.store import RunStore

    path = store_path()
    if not path.is_file():
        raise LaunchError(f"no run store at {path}; run an experiment first, or set DTRAIN_RUNS_ROOT to the "
                          "directory that holds metrics.db")
    return RunStore(path)


def _cmd_experiments_list(args: argparse.Namespace) -> int:
    store = _open_store()
    rows = store.experiments()
    store.close()
    records = []
    for experiment, trial in rows:
        summary = (trial.summary if trial else None) or {}
        records.append({"id": experiment.id, "name": experiment.name,
                        "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(experiment.created_at)),
                        "status": trial.status if trial else "-", "workers": trial.world_size if trial else None,
                        "batches": summary.get("steps_completed"), "validation": summary.get("validation") or {},
                        "run_dir": trial.run_dir if trial else None})
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    if not records:
        print("no experiments yet")
        return 0
    print(f"{'id':>4}  {'name':<28} {'created':<16}  {'status':<9} {'workers':>7} {'batches':>8}  validation")
    for r in records:
        metrics = " ".join(f"{k}={v:.4f}" for k, v in sorted(r["validation"].items()))
        print(f"{r['id']:>4}  {r['name'][:28]:<28} {r['created']:<16}  {r['status']:<9} {r['workers'] or '-':>7} "
              f"{r['batches'] if r['batches'] is not None else '-':>8}  {metrics}")
    return 0


def _cmd_experiments_show(args: argparse.Namespace) -> int:
    from dtrain.errors import LaunchError

    store = _open_store()
    experiment = store.experiment(args.id)
    if experiment is None:
        store.close()
        raise LaunchError(f"experiment {args.id} is not in the store; `dtrain experiments list` shows the ids")
    trials = store.trials(args.id)
    detail = []
    for trial in trials:
        detail.append({"trial_id": trial.id, "status": trial.status, "run_dir": trial.run_dir,
                       "world_size": trial.world_size, "summary": trial.summary,
                       "validation": store.metric_series(trial.id, "validation"),
                       "training": {k: v[-1] for k, v in store.metric_series(trial.id, "training").items()}})
    store.close()
    if args.json:
        print(json.dumps({"id": experiment.id, "name": experiment.name, "config": experiment.config,
                          "trials": detail}, indent=2))
        return 0
    print(f"experiment {experiment.id}: {experiment.name}"
          + (f" - {experiment.description}" if experiment.description else ""))
    print(f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(experiment.created_at))}")
    for trial in detail:
        print(f"\ntrial {trial['trial_id']}: {trial['status']}, {trial['world_size']} worker(s), run dir "
              f"{trial['run_dir']}")
        summary = trial["summary"] or {}
        if summary:
            print(f"  {summary.get('steps_completed')} batches, {summary.get('wall_seconds', 0):.0f} s, "
                  f"{summary.get('samples_per_second', 0):,.0f} samples/s, checkpoint {summary.get('checkpoint')}")
        if trial["validation"]:
            names = sorted(trial["validation"])
            steps = sorted({step for series in trial["validation"].values() for step, _ in series})
            print("  validation:")
            print("    " + f"{'batch':>8}  " + "  ".join(f"{n:>12}" for n in names))
            lookup = {n: dict(trial["validation"][n]) for n in names}
            for step in steps:
                print("    " + f"{step:>8}  " + "  ".join(
                    f"{lookup[n][step]:>12.4f}" if step in lookup[n] else f"{'':>12}" for n in names))
        if trial["training"]:
            last = ", ".join(f"{k} {v[1]:.4g}" for k, v in sorted(trial["training"].items()))
            print(f"  last training report: {last}")
    print("\nconfig:\n" + "\n".join("  " + line for line in experiment.config.splitlines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
