"""`dtrain horovodrun`: horovodrun's command line on torchrun's elastic agent. Any command runs on every slot
with Horovod's variables set, and `import horovod.torch as hvd` resolves to dtrain's implementation
(docs/horovod.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dtrain.errors import ExitCode, LaunchError

EXAMPLES = """examples:
  dtrain horovodrun -np 2 python train.py --epochs 3
  dtrain horovodrun -np 2 -H localhost:2 --timeline-filename timeline.json python train.py
  dtrain horovodrun -np 3 --min-np 2 --max-np 3 python elastic_train.py    # goes on at 2 if one is lost
  dtrain horovodrun --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python elastic_train.py
  dtrain horovodrun -np 4 -H a:2,b:2 --node-rank 0 python train.py         # on host a; --node-rank 1 on b
  dtrain horovodrun --mpi -np 2 python train.py                            # started by mpirun instead
  dtrain horovodrun --mpi -np 4 -H a:2,b:2 python train.py                 # on host a: mpirun starts b's too
"""


def register(subcommands: Any) -> argparse.ArgumentParser:
    """Add `dtrain horovodrun`."""
    parser = subcommands.add_parser(
        "horovodrun", help="run a Horovod script unchanged (horovodrun's flags)",
        description="Run COMMAND on every slot like horovodrun --gloo does, on torchrun's elastic agent: each "
                    "process gets HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, ... and `import horovod.torch` "
                    "gives dtrain's implementation (unless the real Horovod is installed; --force overrides). "
                    "`python`/`python3` at the head of COMMAND is the interpreter dtrain runs in.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--num-proc", dest="np", type=int, help="number of processes (default: the slots "
                        "of -H, or 1)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host:slots,... (local names run here; other hosts need "
                       "--node-rank, or --mpi: mpirun starts them)")
    hosts.add_argument("-hostfile", "--hostfile", help="a file with one `host slots=N` or `host:N` per line")
    hosts.add_argument("--host-discovery-script", help="elastic: an executable printing host:slots lines (this "
                       "host's names only), run every second: more slots grow the job at its next commit")
    parser.add_argument("--node-rank", type=int, help="dtrain's addition for several machines: this host's "
                        "position in -H (horovodrun would ssh; dtrain runs the same command on each host)")
    parser.add_argument("-p", "--master-port", "--ssh-port", dest="master_port", type=int, default=29411,
                        help="rendezvous port on the first host of -H, several machines only (default 29411)")
    parser.add_argument("--network-interface", "--network-interfaces", dest="network_interface",
                        help="the interface gloo uses (GLOO_SOCKET_IFNAME)")
    parser.add_argument("--start-timeout", type=float, default=30.0, help="seconds to wait for every process "
                        "to join (default 30)")
    parser.add_argument("--timeline-filename", help="write a Chrome-trace timeline of the collectives (rank 0 "
                        "here; rank r to FILE.rank-r)")
    parser.add_argument("--timeline-mark-cycles", action="store_true", help="accepted; cycles are not marked")
    parser.add_argument("--fusion-threshold-mb", type=float, help="largest fused gradient buffer, MB (default "
                        "128; 0 = no fusion)")
    parser.add_argument("--cycle-time-ms", type=float, help="ms the negotiation's background thread waits "
                        "after a post before its cycle (default 1; a rank waiting for the operation runs it at once)")
    parser.add_argument("--cache-capacity", type=int, help="entries of the negotiation's response cache "
                        "(default 1024; 0 = every cycle negotiates in full)")
    parser.add_argument("--hierarchical-allreduce", action="store_true", help="accepted and reported as ignored "
                        "(gloo all-reduce is flat)")
    parser.add_argument("--autotune", action="store_true", help="accepted and reported as ignored")
    parser.add_argument("--gloo", action="store_true", help="accepted: gloo is the only controller")
    parser.add_argument("--mpi", action="store_true", help="start the processes with the mpirun on PATH (Open MPI "
                        "or MPICH) instead of torchrun's agent; prints the mpirun command line it runs")
    parser.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, help="elastic: fewest processes; "
                        "a lost worker's peers go on without it from the last commit (Horovod Elastic)")
    parser.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, help="elastic: most processes")
    parser.add_argument("--reset-limit", type=int, help="elastic: most changes of size (default: any); without "
                        "--min-np/--max-np: restarts of every process at the same size (default 0)")
    parser.add_argument("--force", action="store_true", help="use dtrain's horovod even if the real one is "
                        "installed")
    parser.add_argument("--check-build", action="store_true", help="print what this Horovod supports and exit")
    parser.add_argument("--shim-path", action="store_true", help="print the folder holding dtrain's `horovod` "
                        "package and exit (put it on PYTHONPATH to run Horovod scripts under your own mpirun)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show torchrun's agent logs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run on every slot")
    parser.set_defaults(handler=horovodrun)
    return parser


def check_build() -> str:
    from dtrain.horovod import basics

    return "\n".join([
        "dtrain horovod (Horovod 0.28.1 PyTorch API on torch.distributed)",
        "Available Frameworks:", "    [ ] TensorFlow", "    [X] PyTorch", "    [ ] MXNet",
        "Available Controllers:", "    [ ] MPI", "    [X] Gloo",
        "Available Tensor Operations:",
        f"    [{'X' if basics.nccl_built() else ' '}] NCCL (CUDA tensors; not run on a GPU here)",
        "    [ ] DDL", "    [ ] CCL", "    [ ] MPI", "    [X] Gloo"])


def _check_gpu_operations(run: Any) -> None:
    """HOROVOD_GPU_OPERATIONS checked here, before the workers start, where this host is every worker's (no -H or
    --hostfile) or the job is elastic: one line instead of every rank's."""
    from dtrain.horovod import backends

    if run.hosts and not run.elastic:
        return
    try:
        backends.check_before_launch(os.environ, run.np, run.elastic)
    except backends.BackendChoiceError as error:
        raise LaunchError(str(error)) from None


def horovodrun(args: argparse.Namespace) -> int:
    from dtrain.horovod.launcher import HorovodRun, discover_hosts, launch, parse_hosts

    if args.check_build:
        print(check_build())
        return ExitCode.OK
    if args.shim_path:
        from dtrain.horovod.exec import SHIM

        print(SHIM)
        return ExitCode.OK
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise LaunchError("no command to run: dtrain horovodrun -np 2 python train.py")
    if args.np is not None and args.np < 1:
        raise LaunchError(f"-np {args.np}: at least one process")
    hosts = []
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile:
        try:
            with open(args.hostfile) as handle:
                hosts = parse_hosts(handle.read())
        except OSError as error:
            raise LaunchError(f"--hostfile {args.hostfile}: {error.strerror}") from None
    elif args.host_discovery_script:
        hosts = discover_hosts(args.host_discovery_script)
    run = HorovodRun(command=command, np=args.np, hosts=hosts, node_rank=args.node_rank,
                     master_port=args.master_port, network_interface=args.network_interface,
                     start_timeout=args.start_timeout, timeline_filename=args.timeline_filename,
                     timeline_mark_cycles=args.timeline_mark_cycles, fusion_threshold_mb=args.fusion_threshold_mb,
                     cycle_time_ms=args.cycle_time_ms, cache_capacity=args.cache_capacity,
                     hierarchical_allreduce=args.hierarchical_allreduce, autotune=args.autotune,
                     min_np=args.min_np, max_np=args.max_np, reset_limit=args.reset_limit, force=args.force,
                     verbose=args.verbose, host_discovery_script=args.host_discovery_script)
    _check_gpu_operations(run)
    if args.mpi:
        from dtrain.horovod.mpi_launch import launch_mpi

        return launch_mpi(run)
    if run.elastic:  # Horovod Elastic: the job follows its members (elastic_driver.py), not torchrun's restarts
        from dtrain.horovod.elastic_driver import launch_elastic

        return launch_elastic(run, run.host_discovery_script)
    return launch(run)
