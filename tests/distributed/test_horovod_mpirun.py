"""Horovod scripts (tests/horovod_scripts/) started by `mpirun -np 2`, with the command line Horovod's docs give,
end with the same final weights as under `dtrain horovodrun -np 2`; so does `dtrain horovodrun --mpi`. Ranks on
several hosts without MASTER_ADDR stop with one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtrain.horovod.exec import SHIM
from tests.conftest import REPO, fashion_mnist_available, subprocess_env

SCRIPTS = REPO / "tests" / "horovod_scripts"
HOROVODRUN = [sys.executable, "-m", "dtrain.cli", "horovodrun"]
MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun is not installed (make setup installs Debian's "
                                  "openmpi-bin as root; or install Open MPI or MPICH)")


def script_args(name: str) -> list[str]:
    if name == "synthetic_benchmark.py":
        return ["--num-iters", "2", "--num-batches-per-iter", "1", "--num-warmup-batches", "1", "--batch-size", "4",
                "--image-size", "16"]
    if name == "elastic_train.py":
        return ["--epochs", "1", "--samples", "128"]
    if name == "elastic_resize.py":  # at a fixed size: mpirun neither loses nor adds processes
        return ["--epochs", "1", "--samples", "96"]
    from dtrain.data.fashion_mnist import find_data_dir

    return ["--epochs", "1", "--train-samples", "256", "--data-dir", str(find_data_dir())]


def _mpirun_line() -> list[str]:
    """Horovod's documented line: Open MPI 4 takes its one-dash options; Open MPI 5 only `--bind-to`/`--map-by`;
    Hydra (MPICH) passes the whole environment by itself."""
    assert MPIRUN is not None
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" not in version:
        return [MPIRUN, "-np", "2"]
    dash = "-" if "(Open MPI) 4." in version else "--"
    return [MPIRUN, "-np", "2", f"{dash}bind-to", "none", f"{dash}map-by", "slot", "-x", "PATH", "-x", "PYTHONPATH"]


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=subprocess_env(**env))
    assert done.returncode == 0, f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    return done


def _final_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_weights(first: Path, second: Path) -> None:
    a, b = _final_weights(first), _final_weights(second)
    assert list(a) == list(b)
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"final weights differ in {different}"


def _under_horovodrun_and_mpirun(script: str, tmp_path: Path) -> list[str]:
    """Run the script under `dtrain horovodrun -np 2` and under the user's own mpirun, check the final weights are
    the same, return the script's arguments."""
    args = [str(SCRIPTS / script), *script_args(script)]
    _run([*HOROVODRUN, "-np", "2", "python", *args, "--save-model", str(tmp_path / "horovodrun.pt")], tmp_path)
    # the user's own mpirun: only the shim on PYTHONPATH (what `dtrain horovodrun --shim-path` prints), the
    # interpreter found by PATH as a user's would be, the root permission by Open MPI's variables
    bin_dir = str(Path(sys.executable).parent)
    _run([*_mpirun_line(), "python", *args, "--save-model", str(tmp_path / "mpirun.pt")], tmp_path,
         PYTHONPATH=os.pathsep.join([str(SHIM), str(REPO)]), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
         OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    assert_same_weights(tmp_path / "horovodrun.pt", tmp_path / "mpirun.pt")
    return args


@needs_mpirun
def test_synthetic_benchmark_under_mpirun_and_horovodrun_mpi(tmp_path: Path) -> None:
    args = _under_horovodrun_and_mpirun("synthetic_benchmark.py", tmp_path)
    done = _run([*HOROVODRUN, "--mpi", "-np", "2", "python", *args, "--save-model", str(tmp_path / "mpi.pt")],
                tmp_path)
    shown = next(line for line in done.stderr.splitlines() if line.startswith("dtrain horovodrun: "))
    assert f"{MPIRUN} -np 2" in shown and ("-x PYTHONPATH" in shown or "-genvlist" in shown)
    assert "Number of GPUs: 2" in done.stdout
    assert_same_weights(tmp_path / "horovodrun.pt", tmp_path / "mpi.pt")


@needs_mpirun
@pytest.mark.parametrize("script", ["elastic_train.py", "elastic_resize.py"])
def test_elastic_trainers_under_mpirun(script: str, tmp_path: Path) -> None:
    _under_horovodrun_and_mpirun(script, tmp_path)


@needs_mpirun
@pytest.mark.slow
@pytest.mark.skipif(not fashion_mnist_available(), reason="Fashion-MNIST is not installed (make setup installs it)")
def test_fashion_mnist_trainer_under_mpirun(tmp_path: Path) -> None:
    _under_horovodrun_and_mpirun("fashion_mnist.py", tmp_path)


def test_ranks_on_several_hosts_without_master_addr_stop_with_one_line(tmp_path: Path) -> None:
    # rank 0 of an Open MPI job of 4 ranks, 2 on this host: as mpirun -np 4 -H a:2,b:2 starts it
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    env = subprocess_env(**environ)
    env.pop("MASTER_ADDR", None)
    done = subprocess.run([sys.executable, "-c", "import dtrain.horovod.torch as hvd; hvd.init()"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "dtrain.horovod: error: Open MPI started ranks on several hosts (OMPI_COMM_WORLD_LOCAL_SIZE=2 of "
        "OMPI_COMM_WORLD_SIZE=4) and no MASTER_ADDR says where rank 0 is; pass rank 0's host to every rank: mpirun "
        "-x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ... (MPICH: -genv MASTER_ADDR <host>), or start with "
        "dtrain horovodrun --mpi -H ..."]
