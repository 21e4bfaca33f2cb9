"""A Horovod script under Open MPI's `mpirun` across two hosts (benchmarks/mpi_hosts.py: two network namespaces on a
bridge, each with its own hostname, Open MPI's remote-launch agent standing in for ssh; needs root, iproute2,
util-linux and Open MPI, skipped with the reason otherwise): one rank per host, with Horovod's documented line and
`-x MASTER_ADDR`, and under `dtrain horovodrun --mpi -H` (which passes rank 0's host itself), ends with the same
final weights as under `dtrain horovodrun -np 2` on one host; without MASTER_ADDR the ranks stop with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.horovod.exec import SHIM
from tests.conftest import REPO, subprocess_env
from tests.distributed.test_horovod_mpirun import SCRIPTS, assert_same_weights, script_args

sys.path.insert(0, str(REPO / "benchmarks"))
from cluster import ClusterUnavailable  # noqa: E402
from mpi_hosts import MpiHosts, mpi_hosts, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SCRIPT = "synthetic_benchmark.py"
HOSTS = "mhhost1:1,mhhost2:1"
HOROVODRUN = [sys.executable, "-m", "dtrain.cli", "horovodrun"]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MpiHosts]:
    try:
        with mpi_hosts(tmp_path_factory.mktemp("mh")) as emulated:
            yield emulated
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))


def on_first_host(hosts: MpiHosts, command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`command` on mhhost1 as a user there runs it: the venv's python first on PATH, dtrain's horovod shim on
    PYTHONPATH (what `dtrain horovodrun --shim-path` prints), Open MPI's root permission and the emulation's agent
    by Open MPI's variables, no MASTER_ADDR."""
    env = subprocess_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                         PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO)]), OMPI_ALLOW_RUN_AS_ROOT="1",
                         OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **hosts.environment())
    for name in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)
    return subprocess.run(hosts.argv(0, command), cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def succeeded(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, f"{done.args}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    return done


def test_a_script_across_two_hosts_ends_as_under_horovodrun(hosts: MpiHosts, tmp_path: Path) -> None:
    args = [str(SCRIPTS / SCRIPT), *script_args(SCRIPT)]
    launched = len(hosts.launched_on())
    succeeded(subprocess.run([*HOROVODRUN, "-np", "2", "python", *args, "--save-model", str(tmp_path / "one.pt")],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300, env=subprocess_env()))
    # Horovod's documented line, rank 0's host passed by hand
    succeeded(on_first_host(hosts, ["mpirun", "-np", "2", "-H", HOSTS, "-bind-to", "none", "-map-by", "slot", "-x",
                                    "MASTER_ADDR=mhhost1", "-x", "PATH", "-x", "PYTHONPATH", "python", *args,
                                    "--save-model", str(tmp_path / "mpirun.pt")], tmp_path))
    assert hosts.launched_on()[launched:] == ["mhhost2"]  # rank 1 ran on the other host, started through the agent
    assert_same_weights(tmp_path / "one.pt", tmp_path / "mpirun.pt")
    # dtrain horovodrun --mpi -H: the same line built, with MASTER_ADDR from rank 0's host
    done = succeeded(on_first_host(hosts, [*HOROVODRUN, "--mpi", "-H", HOSTS, "python", *args, "--save-model",
                                           str(tmp_path / "mpi.pt")], tmp_path))
    shown = next(line for line in done.stderr.splitlines() if line.startswith("dtrain horovodrun: "))
    assert f"-np 2 -H {HOSTS} --bind-to none --map-by slot --allow-run-as-root" in shown
    assert "-x MASTER_ADDR=mhhost1" in shown
    assert hosts.launched_on()[launched:] == ["mhhost2", "mhhost2"]
    assert_same_weights(tmp_path / "one.pt", tmp_path / "mpi.pt")


def test_across_hosts_without_master_addr_the_ranks_stop_with_one_line(hosts: MpiHosts, tmp_path: Path) -> None:
    done = on_first_host(hosts, ["mpirun", "-np", "2", "-H", HOSTS, "-bind-to", "none", "-map-by", "slot", "-x",
                                 "PATH", "-x", "PYTHONPATH", "python", "-c", "import horovod.torch as hvd; hvd.init()"],
                         tmp_path)
    assert done.returncode != 0
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "dtrain.horovod: error" in line]
    assert errors == [
        "dtrain.horovod: error: Open MPI started ranks on several hosts (OMPI_COMM_WORLD_LOCAL_SIZE=1 of "
        "OMPI_COMM_WORLD_SIZE=2) and no MASTER_ADDR says where rank 0 is; pass rank 0's host to every rank: mpirun "
        "-x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ... (MPICH: -genv MASTER_ADDR <host>), or start with "
        "dtrain horovodrun --mpi -H ..."]
