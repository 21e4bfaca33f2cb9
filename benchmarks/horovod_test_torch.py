"""Horovod's own PyTorch test file (test/parallel/test_torch.py, read from Horovod's repository, kept outside this
one) under `dtrain horovodrun -np 2`: each test alone (a hang counts as a failure at --timeout), then the file run
whole once (--whole-timeout), and the pass rate over the tests that apply to CPU.

    python benchmarks/horovod_test_torch.py /tmp/hvdtests/test_torch.py --jobs 3

The test file imports `common` (mpi_env_rank_and_size, skip_or_fail_gpu_test, temppath) from its own folder: put a
module of yours there. Nothing of Horovod's is in this script; it only names the tests (read with `ast`) and runs
pytest on them. Writes benchmarks/results/horovod_test_torch.json and .md.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORKERS = 2
# Failures that no implementation of today's Horovod API could pass, each recognised by the test's name AND a
# fragment of its failure message (any other failure of the same test still counts as a failure). The file read at
# Horovod commit 0187e71 predates these changes of Horovod's own (its 0.28.1 release, which dtrain follows):
OLDER_HOROVOD = {
    "test_horovod_allgather_grad": ("differs from expected", "expects the allgather gradient to be a Sum-allreduce; "
                                    "Horovod's later mpi_ops.py (and dtrain) Average it"),
    "test_horovod_broadcast_grad": ("differs from expected", "expects the root's broadcast gradient to be a "
                                    "Sum-allreduce; Horovod's later mpi_ops.py (and dtrain) Average it"),
    "test_horovod_alltoall": ("'tuple' object has no attribute", "expects alltoall(tensor, splits) to return a "
                              "tensor; Horovod's later API (and dtrain) returns (tensor, received_splits) when splits "
                              "are given"),
    "test_horovod_alltoall_grad": ("'tuple' object has no attribute", "the same alltoall return value, in its "
                                   "gradient test"),
    "test_sparse_embeddings": ("unexpected keyword argument 'sparse'", "passes DistributedOptimizer(..., "
                               "sparse=True), a keyword Horovod's optimizer had at this commit and replaced by "
                               "sparse_as_dense before 0.28.1 (whose API dtrain follows; sparse gradients stay sparse "
                               "by default there)"),
}
# Python 3.11 removed inspect.getargspec, which the file's optimizer tests call before any Horovod API.
PYTHON_TOO_NEW = "module 'inspect' has no attribute 'getargspec'"
# Behaviour of torch that changed under the file (torch 2.13 here), whatever Horovod does:
TORCH_TOO_NEW = {
    "test_dynamic_requires_grad": ("'NoneType' object has no attribute 'max'", "reads .grad of parameters after "
                                   "zero_grad(), which sets them to None since torch 2.0 (it zeroed them before)"),
    "test_horovod_join_allreduce": ("hvd.join with hvd.allreduce produces incorrect results", "its reference for an "
                                    "integer average is floor_divide, which truncated toward zero before torch 1.13 "
                                    "and floors since; Horovod's (and dtrain's) integer average truncates"),
}


def test_names(path: Path) -> list[str]:
    """The test methods of the file's TestCase classes, as pytest collects them (a name defined twice runs once)."""
    names: dict[str, None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    names[f"{node.name}::{item.name}"] = None
    return list(names)


def horovodrun(test_file: Path, selector: str, out: Path, timeout: float, stall_shutdown: float = 0.0
               ) -> tuple[int | None, float, str]:
    """Run pytest on `selector` (`::TorchTests::name`, "" for the whole file, or node ids after a space) under
    `dtrain horovodrun -np 2`, each rank writing out/rank-<r>.xml; `stall_shutdown` (seconds) is given to the
    ranks as HOROVOD_STALL_SHUTDOWN_TIME_SECONDS."""
    out.mkdir(parents=True, exist_ok=True)
    target = test_file.name + selector if selector.startswith("::") or not selector else selector
    pytest = (f"{sys.executable} -m pytest -p no:cacheprovider -q -rA {target} "
              f"--junitxml={out}/rank-$HOROVOD_RANK.xml")
    command = [sys.executable, "-m", "dtrain.cli", "horovodrun", "-np", str(WORKERS), "bash", "-c", pytest]
    env = dict(os.environ)
    if stall_shutdown > 0:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = f"{stall_shutdown:g}"
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=test_file.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env=env)
    try:
        output, _ = process.communicate(timeout=timeout)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        # the ranks run in sessions of their own: taken by pid before the agent goes, so none is left holding the
        # pipe open (communicate() would wait for ever)
        ranks = common.descendants(common.process_parents(), process.pid)
        os.killpg(process.pid, signal.SIGTERM)  # the agent stops its workers
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            output, _ = process.communicate()
        code = None
    (out / "output.log").write_text(output)
    return code, time.monotonic() - start, output


def rank_outcomes(out: Path) -> dict[int, dict[str, tuple[str, str]]]:
    """Per rank: test name -> (passed | failed | skipped, message) from the rank's JUnit XML."""
    ranks: dict[int, dict[str, tuple[str, str]]] = {}
    for rank in range(WORKERS):
        path = out / f"rank-{rank}.xml"
        if not path.exists():
            continue
        cases: dict[str, tuple[str, str]] = {}
        for case in ElementTree.parse(path).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = "skipped" if child.tag == "skipped" else "failed"
                    message = (child.get("message") or "").splitlines()[0][:300] if child.get("message") else ""
            cases[case.get("name", "")] = (outcome, message)
        ranks[rank] = cases
    return ranks


def combine(name: str, ranks: dict[int, dict[str, tuple[str, str]]], hung: bool) -> dict[str, Any]:
    """One test's outcome over both ranks: passed only if every rank passed; a missing rank or a hang fails it."""
    per_rank = [ranks.get(rank, {}).get(name) for rank in range(WORKERS)]
    if hung and any(result is None for result in per_rank):
        return {"outcome": "failed", "message": "hang (killed at the timeout)"}
    if any(result is None for result in per_rank):
        return {"outcome": "failed", "message": "a rank reported nothing (crashed or never started)"}
    outcomes = {result[0] for result in per_rank if result}
    messages = [f"rank {rank}: {result[1]}" for rank, result in enumerate(per_rank) if result and result[1]]
    if outcomes == {"passed"}:
        return {"outcome": "passed", "message": ""}
    if outcomes == {"skipped"}:
        return {"outcome": "skipped", "message": messages[0].split(": ", 1)[1] if messages else ""}
    return {"outcome": "failed", "message": " | ".join(messages)}


def classify(result: dict[str, Any], name: str) -> str:
    """passed, failed, or why a test does not count: skipped (GPU-only, skipped by Horovod itself), or failed for a
    reason outside the implementation (the Python the file needs, an older Horovod's semantics)."""
    if result["outcome"] == "failed":
        older = OLDER_HOROVOD.get(name)
        if older and older[0] in result["message"]:
            return "not comparable: older Horovod semantics"
        if PYTHON_TOO_NEW in result["message"]:
            return "not comparable: needs Python < 3.11"
        torch_change = TORCH_TOO_NEW.get(name)
        if torch_change and torch_change[0] in result["message"]:
            return "not comparable: needs an older torch"
    if result["outcome"] != "skipped":
        return result["outcome"]
    message = result["message"].lower()
    if "gpu" in message or "cuda" in message:
        return "not applicable: GPU"
    return "not applicable: skipped by the file"


_STARTS = threading.Lock()
START_GAP_SECONDS = 3.0  # jobs started at the same instant could be handed the same free port by their agents


def run_alone(test_file: Path, name: str, scratch: Path, timeout: float) -> dict[str, Any]:
    out = scratch / name.replace("::", "-")
    with _STARTS:  # held for the gap: starts are spaced out
        time.sleep(START_GAP_SECONDS)
    code, seconds, output = horovodrun(test_file, f"::{name}", out, timeout)
    result = combine(name.split("::")[-1], rank_outcomes(out), code is None)
    result.update(test=name, seconds=round(seconds, 1), exit_code=code,
                  category=classify(result, name.split("::")[-1]))
    if result["outcome"] == "failed" and not result["message"]:
        result["message"] = output.strip().splitlines()[-1][:300] if output.strip() else ""
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for result in results:
        counts[result["category"]] = counts.get(result["category"], 0) + 1
    passed = counts.get("passed", 0)
    applicable = passed + counts.get("failed", 0)
    not_comparable = sum(count for category, count in counts.items() if category.startswith("not comparable"))
    return {"tests": len(results), "counts": counts, "applicable": applicable, "passed": passed,
            "pass_rate": passed / applicable if applicable else 0.0,
            "pass_rate_counting_not_comparable_as_failed": passed / (applicable + not_comparable)
            if applicable + not_comparable else 0.0}


def run_whole(test_file: Path, selector: str, names: list[str], out: Path, args: Any) -> dict[str, Any]:
    """One pytest session over `selector` (the whole file when empty), both ranks' outcomes per test."""
    code, seconds, _ = horovodrun(test_file, selector, out, args.whole_timeout, args.stall_shutdown)
    ranks = rank_outcomes(out)
    whole_results = []
    for name in names:
        result = combine(name.split("::")[-1], ranks, code is None)
        result.update(test=name, category=classify(result, name.split("::")[-1]))
        whole_results.append(result)
    print(f"whole run ({len(names)} tests): {'hung' if code is None else 'ended'} in {seconds:.0f} s", flush=True)
    return {"ran": True, "hung": code is None, "exit_code": code, "seconds": round(seconds, 1),
            **summary(whole_results), "outcomes": {result["test"]: result["category"] for result in whole_results}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", type=Path, help="Horovod's test/parallel/test_torch.py, outside this repo")
    parser.add_argument("--horovod-commit", default="unknown", help="the Horovod commit the file was read at")
    parser.add_argument("--jobs", type=int, default=3, help="tests run at once (each is 2 processes)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one test counts as hung")
    parser.add_argument("--whole-timeout", type=float, default=3600.0, help="seconds for the whole file")
    parser.add_argument("-k", dest="only", help="run only the tests whose name contains this")
    parser.add_argument("--skip-whole", action="store_true", help="do not run the file whole")
    parser.add_argument("--stall-shutdown", type=float, default=60.0,
                        help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS for the whole-file runs (Horovod's default, 0, "
                             "never shuts down: ranks that a test sent down different paths then wait for ever, "
                             "as under Horovod)")
    args = parser.parse_args()
    test_file = args.test_file.resolve()
    names = [name for name in test_names(test_file) if not args.only or args.only in name]
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-hvdtests-"))
    results: list[dict[str, Any]] = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_alone, test_file, name, scratch, args.timeout): name for name in names}
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            results.append(result)
            print(f"{result['category']:<38} {result['seconds']:7.1f}s {result['test']} {result['message'][:120]}",
                  flush=True)
    results.sort(key=lambda result: names.index(result["test"]))
    alone = summary(results)
    whole: dict[str, Any] = {"ran": False}
    comparable: dict[str, Any] = {"ran": False}
    if not args.skip_whole:
        whole = run_whole(test_file, "", names, scratch / "whole", args)
        # the same run without the tests no implementation of today's API could pass: several of them fail on one
        # rank only (a rank-dependent expected value), which sends the ranks down different paths under Horovod too
        kept = sorted((r["test"] for r in results if not r["category"].startswith("not comparable")),
                      key=lambda name: name.split("::")[-1])  # pytest runs a TestCase's tests by name
        comparable = run_whole(test_file, " ".join(f"{test_file.name}::{name}" for name in kept), kept,
                               scratch / "whole-comparable", args)
    headline = {"pass_rate_alone": alone["pass_rate"],
                "pass_rate_alone_counting_not_comparable_as_failed":
                    alone["pass_rate_counting_not_comparable_as_failed"],
                "passed_alone": alone["passed"],
                "applicable_alone": alone["applicable"], "tests": alone["tests"], "counts_alone": alone["counts"],
                "whole_file_hung": whole.get("hung"), "passed_whole": whole.get("passed"),
                "applicable_whole": whole.get("applicable"), "whole_seconds": whole.get("seconds"),
                "comparable_whole_hung": comparable.get("hung"), "passed_comparable_whole": comparable.get("passed"),
                "applicable_comparable_whole": comparable.get("applicable"),
                "comparable_whole_seconds": comparable.get("seconds"),
                "stall_shutdown_seconds": args.stall_shutdown,
                "target": "pass_rate_alone >= 0.95, whole file no hang",
                "workers": WORKERS}
    command = (f"python benchmarks/horovod_test_torch.py {args.test_file} --horovod-commit {args.horovod_commit} "
               f"--jobs {args.jobs} --timeout {args.timeout:g} --whole-timeout {args.whole_timeout:g} "
               f"--stall-shutdown {args.stall_shutdown:g}")
    rows = [{key: result[key] for key in ("test", "category", "message", "seconds", "exit_code")}
            for result in results]
    for row in rows:
        short = row["test"].split("::")[-1]
        if row["category"] == "not comparable: older Horovod semantics":
            row["cause"] = OLDER_HOROVOD[short][1]
        elif row["category"] == "not comparable: needs an older torch":
            row["cause"] = TORCH_TOO_NEW[short][1]
    lines = [f"# Horovod's test_torch.py under `dtrain horovodrun -np {WORKERS}`", "",
             f"Horovod commit {args.horovod_commit}; dtrain commit {common.STARTED['commit']}.", "",
             f"Each test alone: **{alone['passed']} of {alone['applicable']} applicable pass "
             f"({100 * alone['pass_rate']:.1f} %)**; counts {alone['counts']}; counting the not comparable as "
             f"failed, {100 * alone['pass_rate_counting_not_comparable_as_failed']:.1f} %.", ""]
    for label, run in (("File run whole", whole), ("File run whole without the not comparable tests", comparable)):
        if run["ran"]:
            lines += [f"{label} (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={args.stall_shutdown:g}): "
                      f"{'hung' if run['hung'] else 'ended'} (exit code {run['exit_code']}, {run['seconds']} s), "
                      f"{run['passed']} of {run['applicable']} pass; counts {run['counts']}.", ""]
    lines += [common.markdown_table(["test", "alone", "message"],
                                    [[r["test"].split("::")[-1], r["category"], r["message"][:100]] for r in results])]
    path = common.write_results("horovod_test_torch", headline, rows, "\n".join(lines), common.machine_info(),
                                {"horovod_file": {"repo": "horovod/horovod", "path": "test/parallel/test_torch.py",
                                                  "commit": args.horovod_commit},
                                 "command": command, "whole_file": whole, "whole_file_comparable": comparable})
    print(f"{alone['passed']}/{alone['applicable']} pass alone ({100 * alone['pass_rate']:.1f} %); wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
