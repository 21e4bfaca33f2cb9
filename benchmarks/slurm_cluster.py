"""A real Slurm cluster on one machine, on the namespace code of cluster.py: munged and slurmctld in the root
network namespace (on a bridge at <subnet>.254), and one slurmd per node namespace (n1 at <subnet>.1, n2 at .2,
...), each node's link capped by `tbf` as in the emulated cluster. Debian's Slurm 22.05 and munge.

    python benchmarks/slurm_cluster.py up      # `make slurm-up`: installs the packages when missing
    export SLURM_CONF=/tmp/dtrain-slurm/slurm.conf
    sbatch examples/clusters/sbatch.sh
    python benchmarks/slurm_cluster.py down    # `make slurm-down`: safe to run twice

Two partitions: `low` (the default) and `high`, whose jobs preempt `low`'s and requeue them (after
GraceTime, with SIGTERM; `--signal` reaches the job at preemption through `preempt_send_user_signal`).

How each daemon is started is what was found to work here: every slurmd in its node's network namespace entered
with nsenter, in a mount and UTS namespace of its own with the cluster's hosts file over /etc/hosts and the node's
hostname (`ip netns exec` remounts /sys, and slurmd then dies setting up its cgroup plugin); one munged serves
every namespace through its socket file (`AuthInfo=socket=`); process tracking by /proc, no task plugin. The
daemons run in the foreground of their own sessions; their pids, the namespaces and links are kept in
state.json in the cluster's directory, so that `down` (another process) stops each by its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import ClusterUnavailable, Network, build_network, remove_network  # noqa: E402
from cluster import unavailable_reason as namespaces_unavailable  # noqa: E402

from dtrain.runs.processes import process_alive  # noqa: E402

DEFAULT_DIR = Path("/tmp/dtrain-slurm")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "mungekey")
PLUGIN_DIR = "/usr/lib/x86_64-linux-gnu/slurm-wlm"
STATE_FILE = "state.json"
REPO = Path(__file__).resolve().parents[1]
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def missing_programs() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def unavailable_reason() -> str | None:
    """None when a Slurm cluster can be started here; otherwise why not, in one line."""
    reason = namespaces_unavailable()
    if reason:
        return reason.replace("the emulated cluster", "the Slurm cluster")
    if missing_programs():
        return (f"Slurm is not installed ({', '.join(missing_programs())} missing): `make slurm-up` installs it, "
                f"or apt-get install {' '.join(PACKAGES)}")
    return None


def install_packages() -> None:
    """Install Debian's Slurm and munge when a program is missing (as root; `apt-get update` first)."""
    if not missing_programs():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES], check=True, env=env,
                   stdout=subprocess.DEVNULL)


@dataclass
class SlurmCluster:
    """A running cluster: its directory (slurm.conf, logs, spool, state), network and daemons' pids."""

    root: Path
    network: Network
    pids: dict[str, int]
    hostnames: list[str]

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    def environment(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF pointing at the cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def job_environment(self, runs_root: Path) -> dict[str, str]:
        """The environment a test or benchmark submits with (sbatch passes it on to the job): SLURM_CONF, this
        Python's bin directory first on PATH (`dtrain`, `python`), this checkout on PYTHONPATH, the runs root."""
        bin_dir = str(Path(sys.executable).parent)
        return {**self.environment(), "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "PYTHONPATH": str(REPO), "DTRAIN_RUNS_ROOT": str(runs_root)}

    def submit(self, argv: list[str], env: dict[str, str], output: Path) -> str:
        """`sbatch --parsable -o OUTPUT ARGV...` from the checkout's root; the job id."""
        done = subprocess.run(["sbatch", "--parsable", "-o", str(output), *argv], env=env, cwd=REPO,
                              capture_output=True, text=True, check=True)
        return done.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=self.environment(), capture_output=True,
                               text=True).stdout
        fields = dict(part.split("=", 1) for part in shown.split() if "=" in part)
        return fields.get("JobState", "UNKNOWN")

    def wait(self, job: str, timeout: float = 600) -> str:
        """Poll the job's state each second until it ends (sbatch --wait backs off to tens of seconds); the final
        state, or TIMEOUT_WAITING when `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in FINAL_STATES:
                return state
            time.sleep(1)
        return "TIMEOUT_WAITING"

    def save(self) -> None:
        state = {"network": self.network.to_json(), "pids": self.pids, "hostnames": self.hostnames}
        (self.root / STATE_FILE).write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, root: Path) -> SlurmCluster | None:
        path = root / STATE_FILE
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        return cls(root, Network.from_json(state["network"]), dict(state["pids"]), list(state["hostnames"]))


def _slurm_conf(root: Path, controller: str, nodes: list[tuple[str, str]], port: int, cpus: int) -> str:
    node_lines = "\n".join(f"NodeName={name} NodeHostname={name} NodeAddr={address} CPUs={cpus} RealMemory=2000"
                           for name, address in nodes)
    names = ",".join(name for name, _ in nodes)
    return f"""# written by benchmarks/slurm_cluster.py
ClusterName=dtrain
SlurmctldHost={socket.gethostname().split('.')[0]}({controller})
SlurmctldPort={port}
SlurmdPort={port + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
PluginDir={PLUGIN_DIR}
StateSaveLocation={root}/state
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/spool/%n/slurmd.pid
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
{node_lines}
PartitionName=low Nodes={names} Default=YES PriorityTier=1 GraceTime=30 MaxTime=INFINITE State=UP
PartitionName=high Nodes={names} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
"""


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Start a daemon in the foreground of a session of its own (it outlives this process); its pid."""
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env)
    return process.pid


def _wait_for(what: str, ready: object, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.2)
    tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.is_file() else []
    raise ClusterUnavailable(f"{what} did not come up within {timeout:.0f} s; last lines of {log}: " + " | ".join(tail))


def slurm_up(root: Path = DEFAULT_DIR, nodes: int = 2, rate: str | None = "200mbit", subnet: str = "10.201.0",
             port: int = 6817, cpus: int = 4) -> SlurmCluster:
    """Start munged, slurmctld and `nodes` slurmd in namespaces; wait until every node is idle. Raises
    ClusterUnavailable (after stopping what it started) when it cannot."""
    reason = unavailable_reason()
    if reason:
        raise ClusterUnavailable(reason)
    if SlurmCluster.load(root) is not None:
        raise ClusterUnavailable(f"a Slurm cluster is already up in {root}; stop it with `make slurm-down` "
                                 f"(python benchmarks/slurm_cluster.py down --dir {root})")
    for sub in ("munge", "state", "log", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    hostnames = [f"n{i + 1}" for i in range(nodes)]
    controller = f"{subnet}.254"
    network = build_network(nodes, rate, subnet=subnet, bridge_address=controller,
                            names=[f"dtslurm{port}-{name}" for name in hostnames])
    cluster = SlurmCluster(root, network, {}, hostnames)
    cluster.save()
    try:
        _start_daemons(cluster, controller, port, cpus)
    except BaseException:
        slurm_down(root)
        raise
    return cluster


def _start_daemons(cluster: SlurmCluster, controller: str, port: int, cpus: int) -> None:
    root = cluster.root
    named = list(zip(cluster.hostnames, [node.address for node in cluster.network.nodes], strict=True))
    hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else "127.0.0.1 localhost\n"
    cluster.hosts_file.write_text(hosts.rstrip("\n") + "\n# the Slurm cluster's nodes\n" + "".join(
        f"{address} {name}\n" for name, address in named) + f"{controller} {socket.gethostname().split('.')[0]}\n")
    cluster.conf.write_text(_slurm_conf(root, controller, named, port, cpus))
    key, sock = root / "munge" / "munge.key", root / "munge" / "munge.socket"
    if not key.is_file():
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    os.chmod(root / "munge", 0o700)
    os.chmod(key, 0o600)
    log = root / "log" / "munged.log"
    cluster.pids["munged"] = _start(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                                     f"--pid-file={root}/munge/munged.pid", f"--log-file={log}",
                                     f"--seed-file={root}/munge/munged.seed"], log)
    cluster.save()
    _wait_for("munged", sock.exists, 20, log)
    env = cluster.environment()
    log = root / "log" / "slurmctld.out"
    cluster.pids["slurmctld"] = _start(["slurmctld", "-D", "-i"], log, env)
    cluster.save()
    _wait_for("slurmctld", lambda: subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True)
              .stdout.count("UP") > 0, 30, log)
    for name, node in zip(cluster.hostnames, cluster.network.nodes, strict=True):
        (root / "spool" / name).mkdir(exist_ok=True)
        log = root / "log" / f"slurmd-{name}.out"
        cluster.pids[f"slurmd-{name}"] = _start(node.wrap_host(["slurmd", "-D", "-N", name], name, cluster.hosts_file),
                                                log, env)
        cluster.save()

    def all_idle() -> bool:
        shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True).stdout
        states = dict(line.split() for line in shown.splitlines() if line.strip())
        return all(states.get(name, "").startswith("idle") for name in cluster.hostnames)

    _wait_for("the slurmd nodes", all_idle, 60, root / "log" / f"slurmd-{cluster.hostnames[-1]}.out")


def _stop(pid: int, name: str) -> bool:
    """SIGTERM the daemon `pid` if it still runs and is `name` (not a reused pid), SIGKILL after 10 s."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    if name.split("-")[0] not in cmdline or not process_alive(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def slurm_down(root: Path = DEFAULT_DIR) -> list[str]:
    """Stop every daemon by its pid (slurmd first, munged last), kill what jobs left in the node namespaces,
    remove namespaces, links and the cluster's directory. Returns what it stopped; nothing when nothing is up."""
    cluster = SlurmCluster.load(root)
    stopped: list[str] = []
    if cluster is not None:
        order = sorted(cluster.pids, key=lambda n: (n.startswith("munged"), n.startswith("slurmctld")))
        for name in order:
            if _stop(cluster.pids[name], name):
                stopped.append(f"{name} (pid {cluster.pids[name]})")
        remove_network(cluster.network)  # the slurmstepds and job processes slurmd left behind too
    if root.is_dir() and (cluster is not None or (root / "slurm.conf").is_file()):
        shutil.rmtree(root, ignore_errors=True)
    return stopped


@contextmanager
def slurm_cluster(root: Path, **options: object) -> Iterator[SlurmCluster]:
    """A cluster for the length of a `with` block (tests, benchmarks); stopped and removed on exit."""
    cluster = slurm_up(root, **options)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        slurm_down(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start or stop a Slurm cluster of network namespaces (root).")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cluster's files (default {DEFAULT_DIR})")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", default="200mbit", help="tbf rate of each node's link, or 'none'")
    args = parser.parse_args(argv)
    if args.action == "down":
        stopped = slurm_down(args.dir)
        print("slurm-down: " + (f"stopped {', '.join(stopped)}; " if stopped else "no daemon was running; ")
              + "namespaces, links and files removed")
        return 0
    if os.geteuid() != 0:
        print("slurm-up: error: needs root (network namespaces, daemons); run it as root", file=sys.stderr)
        return 2
    install_packages()
    try:
        cluster = slurm_up(args.dir, nodes=args.nodes, rate=None if args.rate == "none" else args.rate)
    except ClusterUnavailable as exc:
        print(f"slurm-up: error: {exc}", file=sys.stderr)
        return 1
    nodes = ", ".join(f"{name} ({node.address})" for name, node in zip(cluster.hostnames, cluster.network.nodes,
                                                                       strict=True))
    print(f"slurm-up: controller {cluster.network.bridge_address}, nodes {nodes}, links "
          f"{'tbf ' + args.rate if args.rate != 'none' else 'uncapped'}; partitions low (default) and high "
          f"(preempts low, requeue)\nSubmit with:\n  export SLURM_CONF={cluster.conf}\n  sinfo\n"
          "  sbatch examples/clusters/sbatch.sh\nStop with: make slurm-down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
