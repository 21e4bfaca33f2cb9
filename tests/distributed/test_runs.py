"""Whole runs through `dtrain run`, torchrun and Slurm-style starts: determinism, resume, restarts, errors."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CONFIG = FIXTURES / "digits.yaml"


def dtrain(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dtrain.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def final_model(run_dir: Path) -> bytes:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    return Path(summary["checkpoint"]).read_bytes()


def completed_run(config: Path, root: Path) -> Path:
    """Run `config` to the end in root/run, with its own store under root/runs; return the run dir."""
    result = dtrain("run", config, "--run-dir", root / "run", env={"DTRAIN_RUNS_ROOT": str(root / "runs")})
    assert result.returncode == 0, result.stderr
    return root / "run"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return completed_run(CONFIG, tmp_path_factory.mktemp("clean"))


def test_clean_run_writes_the_contract_files(clean_run: Path) -> None:
    summary = json.loads((clean_run / "summary.json").read_text())
    for key in ("status", "world_size", "global_batch_size", "per_slot_batch_size", "steps_completed",
                "epochs_completed", "samples_per_second", "wall_seconds", "validation", "validation_history",
                "checkpoint", "restarts"):
        assert key in summary, key
    assert summary["world_size"] == 2 and summary["per_slot_batch_size"] == 32 and summary["steps_completed"] == 40
    assert [entry["step"] for entry in summary["validation_history"]] == [10, 20, 30, 40]
    assert all(set(e) == {"step", "epoch", "wall_seconds", "metrics"} for e in summary["validation_history"])
    walls = [e["wall_seconds"] for e in summary["validation_history"]]
    assert walls == sorted(walls)
    assert summary["validation"]["accuracy"] > 0.8
    state = torch.load(summary["checkpoint"], weights_only=True)
    assert set(state) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    assert (clean_run / "checkpoints" / "latest").read_text().strip() == "step-40"
    assert yaml.safe_load((clean_run / "config.yaml").read_text())["name"] == "digits_test"
    assert (clean_run / "logs" / "rank-0.log").is_file() and (clean_run / "logs" / "rank-1.log").is_file()
    assert list((clean_run / "tensorboard").glob("events.out.tfevents.*"))


def test_same_config_and_seed_give_identical_model(clean_run: Path, tmp_path: Path) -> None:
    result = dtrain("run", CONFIG, "--run-dir", tmp_path / "again")
    assert result.returncode == 0, result.stderr
    assert final_model(tmp_path / "again") == final_model(clean_run)


@pytest.mark.slow  # starts `dtrain run` two or more times
def test_stopped_run_resumes_bitwise_identical(clean_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    stopped = dtrain("run", CONFIG, "--set", "faults.stop_after_batch=15", "--run-dir", run_dir)
    assert stopped.returncode == 3, stopped.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-15"
    resumed = dtrain("run", CONFIG, "--run-dir", run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "(resuming)" in resumed.stderr
    assert final_model(run_dir) == final_model(clean_run)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumes"] == 1
    clean_history = json.loads((clean_run / "summary.json").read_text())["validation_history"]
    assert [e["metrics"] for e in summary["validation_history"]] == [e["metrics"] for e in clean_history]


@pytest.mark.slow  # starts `dtrain run` two or more times
def test_local_sgd_run_resumes_bitwise_identical_with_each_rank_s_own_momentum(tmp_path: Path) -> None:
    """Between averaging rounds each rank's momentum is its own; a checkpoint keeps every rank's, so a stopped
    local SGD run resumes where an uninterrupted one goes (with rank 0's momentum on every rank it would not)."""
    local = ["--set", "distributed.strategy=local_sgd", "--set", "distributed.local_sgd.period=4",
             "--set", "searcher.max_length={batches: 30}"]
    whole = dtrain("run", CONFIG, *local, "--run-dir", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    stopped = dtrain("run", CONFIG, *local, "--set", "faults.stop_after_batch=20", "--run-dir", tmp_path / "resumed")
    assert stopped.returncode == 3, stopped.stderr
    resumed = dtrain("run", CONFIG, *local, "--run-dir", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert final_model(tmp_path / "resumed") == final_model(tmp_path / "whole")


@pytest.mark.slow  # starts `dtrain run` two or more times
def test_auto_tuned_fusion_run_resumes_bitwise_identical(tmp_path: Path) -> None:
    """A 2.4 MB model tunes between two bucket sizes in its first 41 batches; a run stopped after tuning
    resumes with the size it chose and ends bitwise where an uninterrupted auto-tuned run ends."""
    tuned = ["--set", "optimizations.auto_tune_tensor_fusion=true", "--set", "hyperparameters.hidden=8192",
             "--set", "searcher.max_length={batches: 50}"]
    whole = dtrain("run", CONFIG, *tuned, "--run-dir", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    assert "auto-tuned, median step ms" in whole.stdout
    tuning = json.loads((tmp_path / "whole" / "summary.json").read_text())["strategy"]["fusion_tuning"]
    assert tuning["done"] and len(tuning["candidates"]) == 2 and len(tuning["visits"]) == 6
    stopped = dtrain("run", CONFIG, *tuned, "--set", "faults.stop_after_batch=45", "--run-dir", tmp_path / "resumed")
    assert stopped.returncode == 3, stopped.stderr
    before = json.loads((tmp_path / "resumed" / "summary.json").read_text())["strategy"]
    resumed = dtrain("run", CONFIG, *tuned, "--run-dir", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr
    after = json.loads((tmp_path / "resumed" / "summary.json").read_text())["strategy"]
    assert after["bucket_cap_mb"] == before["bucket_cap_mb"]
    assert after["fusion_tuning"]["restored"] and not before["fusion_tuning"]["restored"]
    assert after["fusion_tuning"]["visits"] == before["fusion_tuning"]["visits"]  # kept, not tuned again
    assert final_model(tmp_path / "resumed") == final_model(tmp_path / "whole")


def test_crashed_worker_is_restarted_and_resumes(clean_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "crashed"
    marker = tmp_path / "crashed-once"
    result = dtrain("run", CONFIG, "--set", "hyperparameters.crash_on_call=25",
                    "--set", f"hyperparameters.crash_marker={marker}", "--set", "hyperparameters.crash_rank=1",
                    "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    assert marker.exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumes"] == 1
    # the hyperparameters differ only in the crash switches, which do not touch the numbers
    assert final_model(run_dir) == final_model(clean_run)


def test_user_trial_file_anywhere(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(FIXTURES / "digits_trial.py", project / "my_trial.py")
    config = yaml.safe_load(CONFIG.read_text())
    config.update(entrypoint="my_trial.py:DigitsTrial", searcher={"max_length": {"batches": 6}},
                  min_validation_period={"batches": 0}, min_checkpoint_period={"batches": 0})
    config["resources"]["slots_per_trial"] = 1
    (project / "experiment.yaml").write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = dtrain("run", project / "experiment.yaml", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert "training completed" in result.stdout
    [run_dir] = (tmp_path / "runs" / "digits_test").iterdir()  # the store root is per test (conftest)
    assert json.loads((run_dir / "summary.json").read_text())["steps_completed"] == 6


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_plain_torchrun_runs_the_worker(clean_run: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "dtrain.worker", str(CONFIG), "--run-dir", str(tmp_path / "tr")],
                            capture_output=True, text=True, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert final_model(tmp_path / "tr") == final_model(clean_run)


def test_slurm_style_start(clean_run: Path, tmp_path: Path) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("DTRAIN_LAUNCHER", "RANK", "WORLD_SIZE")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NNODES="1",
                   SLURM_NODEID="0", SLURM_JOB_ID="4242", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "dtrain.worker", str(CONFIG), "--run-dir",
                                       str(tmp_path / "slurm")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert final_model(tmp_path / "slurm") == final_model(clean_run)


def test_slurm_without_master_addr_is_one_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_ID="1")
    result = subprocess.run([sys.executable, "-m", "dtrain.worker", str(CONFIG), "--run-dir", str(tmp_path / "s")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "SLURM_JOB_NODELIST is not set, so the master is unknown; export MASTER_ADDR" in result.stderr
    assert "Traceback" not in result.stderr


def test_data_error_in_a_worker_fails_fast_without_restarts(tmp_path: Path) -> None:
    project = tmp_path / "p"
    project.mkdir()
    (project / "bad_trial.py").write_text(
        "from dtrain.data import load_fashion_mnist\n"
        "import sys; sys.path.insert(0, {!r})\n"
        "from digits_trial import DigitsTrial\n"
        "class BadData(DigitsTrial):\n"
        "    def build_training_data(self):\n"
        "        return load_fashion_mnist('train', {!r})\n".format(str(FIXTURES), str(tmp_path / "no-data")))
    config = yaml.safe_load(CONFIG.read_text())
    config.update(entrypoint="bad_trial.py:BadData", max_restarts=5)
    (project / "e.yaml").write_text(yaml.safe_dump(config))
    result = dtrain("run", project / "e.yaml", "--run-dir", tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert len(error_lines) == 1 and "Fashion-MNIST's four IDX files are not in" in error_lines[0]
    assert "Traceback" not in result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


@pytest.mark.slow  # starts `dtrain run` two or more times
def test_parameter_server_run_stops_resumes_and_reports(tmp_path: Path) -> None:
    """3 workers (one 3x slower) and 2 servers in ssp mode: started by plain torchrun with 5 processes and stopped
    after batch 20, resumed by `dtrain run` (the servers' state comes back from the checkpoint), with the per-run
    figures in summary.json and the store."""
    from dtrain.runs.store import RunStore

    run_dir, env = tmp_path / "ps", {"DTRAIN_RUNS_ROOT": str(tmp_path / "runs")}
    settings = ["--set", "distributed.strategy=parameter_server", "--set", "distributed.parameter_server.servers=2",
                "--set", "distributed.parameter_server.mode=ssp", "--set", "distributed.parameter_server.staleness=2",
                "--set", "resources.slots_per_trial=3", "--set", "hyperparameters.global_batch_size=48",
                "--set", "faults.slow_rank=2", "--set", "faults.slow_factor=3", "--set", "scheduling_unit=10"]
    torchrun_env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"} | env
    stopped = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "5",
                              "-m", "dtrain.worker", str(CONFIG), *settings, "--set", "faults.stop_after_batch=20",
                              "--run-dir", str(run_dir)], capture_output=True, text=True, env=torchrun_env, timeout=240)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-20"
    first = json.loads((run_dir / "summary.json").read_text())["strategy"]
    resumed = dtrain("run", CONFIG, *settings, "--run-dir", run_dir, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in (run_dir / "logs").glob("server-*.log")) == ["server-0.log", "server-1.log"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 3 and summary["resumes"] == 1
    assert summary["validation"]["accuracy"] > 0.6
    strategy = summary["strategy"]
    assert strategy["name"] == "parameter_server" and strategy["mode"] == "ssp"
    assert strategy["shard_bytes"][0] == strategy["shard_bytes"][1]
    servers = strategy["per_server"]
    # the resumed servers continued the counters: every gradient of both launches is in the histogram
    assert sum(strategy["staleness_histogram"].values()) == sum(s["pushes"] for s in servers)
    assert all(s["pushes"] > sum(p["pushes"] for p in first["per_server"]) / 2 for s in servers)
    assert all(s["max_clock_gap"] <= 2 and s["global_step"] >= 40 for s in servers)
    assert all(s["bytes_pushed_per_step"] > 0 and s["bytes_pulled_per_step"] > 0 for s in servers)
    assert len(strategy["held_seconds_per_worker"]) == 3
    store = RunStore(tmp_path / "runs" / "metrics.db")
    series = store.metric_series(1, "training")
    store.close()
    assert {"ps_staleness_mean", "ps_worker_wait_seconds", "ps0_bytes_pushed_per_step",
            "ps1_bytes_pulled_per_step"} <= set(series)
