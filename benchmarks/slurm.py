"""What Slurm costs dtrain, on the 2-node Slurm cluster of benchmarks/slurm_cluster.py (root; Debian's Slurm,
installed when missing):

- `slurm_overhead_ratio`: the demo experiment (examples/fashion_mnist/distributed.yaml, 2 nodes x 2 workers, a
  fixed number of batches) submitted with `sbatch examples/clusters/sbatch.sh`, seconds from sbatch to the job's
  end (its state polled every 0.2 s), over the same experiment started by hand with `dtrain run --nnodes 2` on the
  namespace cluster (cluster.py, the same 200 Mbit/s links), seconds from start to the end of both nodes' processes;
  paired rounds (A B, B A, ...), target <= 1.02;
- `preemption_seconds_to_checkpoint` / `preemption_batches_redone`: one run of the digits fixture preempted by a
  job of the `high` partition: seconds from Slurm's PreemptTime (whole seconds) to the checkpoint on disk, and the
  batches the requeued run did again (summary.json's `preemptions`); the begin-time hold of the requeued job is
  lifted (`scontrol update StartTime=now`), so the wait Slurm adds before a requeued job starts is not counted.

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/slurm.py            # 3 rounds, ~10 min
    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/slurm.py --quick    # 1 round
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
DEMO = ROOT / "examples" / "fashion_mnist" / "distributed.yaml"
DIGITS = ROOT / "tests" / "fixtures" / "digits.yaml"


def log(message: str) -> None:
    print(f"[slurm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _settings(batches: int) -> list[str]:
    return ["--set", f"searcher.max_length={{batches: {batches}}}", "--set", f"min_validation_period={{batches: "
            f"{batches}}}", "--set", "min_checkpoint_period={batches: 0}", "--set", "checkpoint_policy=none"]


def _wait(slurm: Any, job: str, poll: float = 0.2, timeout: float = 1200) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = slurm.job_state(job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return str(state)
        time.sleep(poll)
    return "TIMEOUT_WAITING"


def under_slurm(slurm: Any, workdir: Path, batches: int, repeat: int) -> dict[str, Any]:
    runs = workdir / f"slurm-runs-{repeat}"
    started = time.perf_counter()
    job = slurm.submit(["examples/clusters/sbatch.sh", str(DEMO), *_settings(batches)], slurm.job_environment(runs),
                       workdir / f"slurm-{repeat}.out")
    state = _wait(slurm, job)
    seconds = time.perf_counter() - started
    if state != "COMPLETED":
        raise RuntimeError(f"job {job} ended {state}: {(workdir / f'slurm-{repeat}.out').read_text()[-2000:]}")
    summary = json.loads((runs / "fashion_mnist_distributed" / f"slurm-{job}" / "summary.json").read_text())
    return {"seconds": seconds, "job": job, "accuracy": summary["validation"]["accuracy"]}


def by_hand(workdir: Path, batches: int, repeat: int, port: int) -> dict[str, Any]:
    from cluster import emulated_cluster

    with emulated_cluster(nodes=2, rate="200mbit") as cluster:
        logs = [(workdir / f"hand-{repeat}-{i}.out").open("w") for i in range(2)]
        started = time.perf_counter()
        processes = [cluster.start(i, cluster.dtrain_run(i, DEMO, workdir / f"hand-{repeat}-{i}", port,
                                                         ["--set", "resources.slots_per_trial=4", *_settings(batches)]),
                                   stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
        codes = [process.wait(timeout=1200) for process in processes]
        seconds = time.perf_counter() - started
    if codes != [0, 0]:
        output = (workdir / f"hand-{repeat}-0.out").read_text()
        raise RuntimeError(f"dtrain run by hand ended {codes}: {output[-2000:]}")
    summary = json.loads((workdir / f"hand-{repeat}-0" / "summary.json").read_text())
    return {"seconds": seconds, "accuracy": summary["validation"]["accuracy"]}


def preemption(slurm: Any, workdir: Path) -> dict[str, Any]:
    """One digits run (1000 batches) preempted at batch 100 or later; its summary's preemption record."""
    runs, output = workdir / "preempt-runs", workdir / "preempt.out"
    settings = ["--set", "searcher.max_length.batches=1000", "--set", "min_checkpoint_period.batches=100000",
                "--set", "min_validation_period.batches=100000"]
    job = slurm.submit(["examples/clusters/sbatch.sh", str(DIGITS), *settings], slurm.job_environment(runs), output)
    deadline = time.monotonic() + 600
    while "batch 100/1000" not in (output.read_text() if output.is_file() else ""):
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not reach batch 100: {output.read_text()[-2000:]}")
        time.sleep(0.5)
    high = slurm.submit(["-p", "high", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4", "--wrap", "sleep 1"],
                        slurm.environment(), workdir / "high.out")
    while "Restarts=1" not in subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm.environment(),
                                             capture_output=True, text=True).stdout:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} was not requeued: {output.read_text()[-2000:]}")
        time.sleep(0.5)
    _wait(slurm, high)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm.environment(), check=True)
    if _wait(slurm, job) != "COMPLETED":
        raise RuntimeError(f"the requeued job {job} did not complete: {output.read_text()[-2000:]}")
    summary = json.loads((runs / "digits_test" / f"slurm-{job}" / "summary.json").read_text())
    record: dict[str, Any] = summary["preemptions"][0]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=120, help="demo batches per run (global batch 256)")
    parser.add_argument("--quick", action="store_true", help="1 round")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)
    from common import alternate, machine_info, markdown_table, ratio_headline, rounds_of, write_results
    from slurm_cluster import install_packages, slurm_cluster, unavailable_reason

    rounds = 1 if args.quick else args.rounds
    if unavailable_reason() is not None:
        install_packages()
    reason = unavailable_reason()
    if reason:
        log(f"skipped: {reason}")
        return 0
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-slurm-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        with slurm_cluster(workdir / "cluster", subnet="10.204.0", port=6847) as slurm:
            ports = iter(range(29760, 29800))
            rows = alternate([("slurm", lambda r: under_slurm(slurm, workdir, args.batches, r)),
                              ("by_hand", lambda r: by_hand(workdir, args.batches, r, next(ports)))], rounds, log)
            preempted = preemption(slurm, workdir)
    headline = {**ratio_headline("slurm_overhead_ratio", rounds_of(rows, "slurm", "seconds"),
                                 rounds_of(rows, "by_hand", "seconds")),
                "preemption_seconds_to_checkpoint": preempted["seconds_to_checkpoint"],
                "preemption_batches_redone": preempted["batches_redone"]}
    table = markdown_table(["round", "variant", "seconds", "accuracy"],
                           [[r["repeat"], r["variant"], f"{r['seconds']:.1f}", f"{r['accuracy']:.4f}"] for r in rows])
    markdown = (f"# slurm.py\n\nslurm_overhead_ratio {headline['slurm_overhead_ratio']:.3f} (per round "
                f"{', '.join(f'{v:.3f}' for v in headline['slurm_overhead_ratio_per_round'])}; the demo, "
                f"{args.batches} batches, 2 x 2 workers); one preemption: {preempted['seconds_to_checkpoint']} s from "
                f"the signal to the checkpoint on disk, {preempted['batches_redone']} batches redone "
                f"({preempted['checkpoint']})\n\n{table}\n")
    path = write_results("slurm", headline, rows, markdown,
                         machine_info("2 network namespaces, tbf 200mbit links; Slurm 22.05 (Debian)"),
                         {"settings": {"rounds": rounds, "batches": args.batches}, "preemption": preempted})
    log(f"wrote {path}: slurm_overhead_ratio {headline['slurm_overhead_ratio']:.3f}, preemption "
        f"{preempted['seconds_to_checkpoint']} s to the checkpoint, {preempted['batches_redone']} batches redone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
