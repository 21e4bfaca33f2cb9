"""The dtrain command: help, bad invocations (one line, exit 2, no traceback) and the store views."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.runs.store import RunStore

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "fashion_mnist" / "distributed.yaml"


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own exits (--help, bad flags)
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "run" in out and "experiments" in out
    code, out, _ = run_cli(capsys, "run", "--help")
    for flag in ("--set", "--run-dir", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint"):
        assert flag in out
    assert "Exit code 0 only when training finished" in " ".join(out.split())


@pytest.mark.parametrize(("args", "message"), [
    (("run", "missing.yaml"), "config file missing.yaml does not exist"),
    (("run", str(DEMO), "--set", "resources.slot_per_trial=2"), "did you mean `resources.slots_per_trial`"),
    (("run", str(DEMO), "--set", "noequals"), "must look like dotted.key=value"),
    (("run", str(DEMO), "--nnodes", "2"), "give the chief's --master-addr and --master-port"),
    (("run", str(DEMO), "--nnodes", "3", "--master-port", "29500"), "must be a multiple of --nnodes"),
    (("run", str(DEMO), "--node-rank", "1"), "--node-rank 1 must be in [0, 0]"),
    (("run", str(DEMO), "--set", "optimizations.mixed_precision=O3"), "`optimizations.mixed_precision` = 'O3'"),
    (("run", str(DEMO), "--set", "entrypoint=model_def:Nope"), "has no attribute `Nope`"),
    (("run", str(DEMO), "--bogus"), "unrecognized arguments: --bogus"),
    (("run", str(DEMO), "--nnodes", "two"), "--nnodes 'two': give a number of nodes N or a range MIN:MAX"),
    (("experiments", "show", "7"), "no run store"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
])
def test_bad_invocations_are_one_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
                                      ) -> None:
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtrain: error:"), err
    assert message in lines[0]
    assert "Traceback" not in err + out


def test_bad_run_dir_is_left_untouched(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "run", str(DEMO), "--run-dir", str(tmp_path))
    assert code == 2 and "not empty" in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def _fill_store(root: Path) -> int:
    store = RunStore(root / "metrics.db")
    experiment = store.create_experiment("demo", "a test", "name: demo\n")
    trial = store.create_trial(experiment, root / "demo" / "1", {"global_batch_size": 8}, 2)
    store.add_metrics(trial, "validation", [(10, 1.0, 3.0, {"accuracy": 0.5}), (20, 2.0, 6.0, {"accuracy": 0.75})])
    store.add_metrics(trial, "training", [(20, 2.0, 6.0, {"loss": 0.25})])
    store.set_status(trial, "completed", {"steps_completed": 20, "validation": {"accuracy": 0.75},
                                          "wall_seconds": 6.0, "samples_per_second": 100.0})
    store.close()
    return experiment


def test_experiments_list_and_show(capsys: pytest.CaptureFixture[str], runs_root: Path) -> None:
    experiment = _fill_store(runs_root)
    code, out, _ = run_cli(capsys, "experiments", "list")
    assert code == 0 and "demo" in out and "completed" in out and "accuracy=0.7500" in out
    code, out, _ = run_cli(capsys, "experiments", "list", "--json")
    assert json.loads(out)[0]["validation"] == {"accuracy": 0.75}
    code, out, _ = run_cli(capsys, "experiments", "show", str(experiment))
    assert code == 0 and "0.5000" in out and "0.7500" in out and "loss 0.25" in out and "name: demo" in out
    code, out, _ = run_cli(capsys, "experiments", "show", str(experiment), "--json")
    assert json.loads(out)["trials"][0]["validation"]["accuracy"] == [[10, 0.5], [20, 0.75]]
    code, _, err = run_cli(capsys, "experiments", "show", "99")
    assert code == 2 and "experiment 99 is not in the store" in err


def test_a_diverged_trial_shows_in_strict_json(capsys: pytest.CaptureFixture[str], runs_root: Path) -> None:
    """A NaN in the store (a diverged trial's metric) prints as the string "NaN" in --json (bare NaN is not JSON)
    and is not taken for the best value."""
    store = RunStore(runs_root / "metrics.db")
    experiment = store.create_experiment("s", "", "name: s\nsearcher: {metric: accuracy, smaller_is_better: false}\n")
    trial = store.create_trial(experiment, runs_root / "s" / "1", {}, 2)
    store.add_metrics(trial, "validation", [(10, 1.0, 3.0, {"accuracy": float("nan")}),
                                            (20, 2.0, 6.0, {"accuracy": 0.75}), (30, 3.0, 9.0, {"accuracy": 0.5})])
    store.close()
    code, out, _ = run_cli(capsys, "experiments", "show", str(experiment), "--json")
    shown = json.loads(out, parse_constant=lambda token: pytest.fail(f"{token} is not JSON"))["trials"][0]
    assert code == 0 and shown["validation"]["accuracy"][0] == [10, "NaN"] and shown["best_metric"] == 0.75
