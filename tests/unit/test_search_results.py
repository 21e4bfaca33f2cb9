"""A search's end: the `best:` line and results.json name the checkpoint of the best trial's best validation (not
its last checkpoint), and results.json numbers brackets from 1, as the terminal does."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dtrain.runs.storage import CheckpointStore
from dtrain.search.progress import SearchProgress, best_checkpoint_of, has_checkpoint
from dtrain.search.results import trial_records
from dtrain.search.spec import parse_searcher


def _run_dir(root: Path, kept: tuple[int, ...]) -> Path:
    """A trial validated at steps 22, 66 (its best accuracy) and 88, checkpointed at the `kept` steps, the last
    one at 88 (what summary.json's `checkpoint` names)."""
    run_dir = root / "trial-0"
    history = [{"step": step, "epoch": 0.0, "wall_seconds": 1.0, "metrics": {"accuracy": value, "loss": 1 - value}}
               for step, value in ((22, 0.80), (66, 0.93), (88, 0.91))]
    for step in kept:
        (run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step}" / "meta.json").write_text("{}")
    last = run_dir / "checkpoints" / "step-88" / "model.pt"
    (run_dir / "summary.json").write_text(json.dumps({"validation_history": history, "checkpoint": str(last)}))
    return run_dir


def _trial(bracket: int | None) -> Any:
    attrs: dict[str, Any] = {"best_metric": 0.93, "batches_trained": 88, "run_dir": "trial-0"}
    if bracket is not None:
        attrs["bracket"] = bracket
    return SimpleNamespace(number=0, state=SimpleNamespace(name="COMPLETE"), params={"lr": 0.1}, value=0.91,
                           user_attrs=attrs, intermediate_values={22: 0.8, 66: 0.93}, datetime_complete=datetime.now())


def test_the_best_line_names_the_best_validations_checkpoint(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, kept=(66, 88))
    assert best_checkpoint_of(run_dir, "accuracy", smaller_is_better=False) == run_dir / "checkpoints/step-66/model.pt"
    assert best_checkpoint_of(run_dir, "validation_loss", smaller_is_better=True) == (
        run_dir / "checkpoints/step-66/model.pt")
    spec = parse_searcher({"name": "random", "max_trials": 1, "max_length": 88, "metric": "accuracy",
                           "smaller_is_better": False})
    table = SearchProgress(spec, 1).final_table([_trial(None)], tmp_path)
    assert table.splitlines()[-1].endswith(f"checkpoint {run_dir / 'checkpoints/step-66/model.pt'}"), table


def test_without_the_best_validations_checkpoint_the_latest_is_named(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, kept=(88,))
    assert best_checkpoint_of(run_dir, "accuracy", smaller_is_better=False) == run_dir / "checkpoints/step-88/model.pt"


def test_results_json_numbers_brackets_as_the_terminal_does(tmp_path: Path) -> None:
    _run_dir(tmp_path, kept=(66, 88))
    first, none = trial_records([_trial(0)], tmp_path, "accuracy", False), trial_records([_trial(None)], tmp_path)
    assert first[0]["bracket"] == 1 and none[0]["bracket"] is None
    assert first[0]["checkpoint"].endswith("step-66/model.pt")
    spec = parse_searcher({"name": "random", "max_trials": 1, "max_length": 88, "metric": "accuracy",
                           "smaller_is_better": False})
    assert "[bracket 1]" in SearchProgress(spec, 1).final_table([_trial(0)], tmp_path)


def test_a_trial_whose_checkpoints_are_in_object_storage_is_resumed_not_started(tmp_path: Path) -> None:
    """The search says "resumed from its checkpoint" when the trial's storage (here fsspec's in-memory object store,
    as run.json records it) names a latest checkpoint, though the run dir has no `checkpoints/` of its own."""
    store = CheckpointStore(url=f"memory://dtrain-search-{uuid.uuid4().hex[:8]}/trial")
    run_dir = tmp_path / "trial-0"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"checkpoints": store.to_json()}))
    assert not has_checkpoint(run_dir)  # the trial ran, but no checkpoint is complete yet
    store.write_bytes("latest", b"step-10\n")
    assert has_checkpoint(run_dir) and not (run_dir / "checkpoints").exists()
    own = tmp_path / "trial-1"
    (own / "checkpoints").mkdir(parents=True)
    assert not has_checkpoint(own)  # a folder without `latest` holds nothing to resume from
    (own / "checkpoints" / "latest").write_text("step-5\n")
    assert has_checkpoint(own) and not has_checkpoint(tmp_path / "trial-2")
