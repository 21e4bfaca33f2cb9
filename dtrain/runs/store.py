"""The run store: one SQLite file (`runs/metrics.db`) with experiments, their trials and every metric.

Rank 0 of each run writes; `dtrain experiments` reads. WAL mode lets several runs share the file.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    config TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    experiment_id INTEGER NOT NULL REFERENCES experiments(id),
    run_dir TEXT NOT NULL,
    hparams TEXT NOT NULL,
    status TEXT NOT NULL,
    world_size INTEGER,
    started_at REAL NOT NULL,
    ended_at REAL,
    summary TEXT
);
CREATE TABLE IF NOT EXISTS metrics (
    trial_id INTEGER NOT NULL REFERENCES trials(id),
    kind TEXT NOT NULL,
    step INTEGER NOT NULL,
    epoch REAL,
    wall_seconds REAL,
    name TEXT NOT NULL,
    value REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS metrics_by_trial ON metrics (trial_id, kind, name, step);
"""


@dataclass(frozen=True)
class TrialRow:
    id: int
    experiment_id: int
    run_dir: str
    status: str
    world_size: int | None
    started_at: float
    ended_at: float | None
    summary: dict[str, Any] | None
    hparams: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExperimentRow:
    id: int
    name: str
    description: str
    config: str
    created_at: float


BUSY_TIMEOUT_S = 30.0  # how long a statement waits for another process's write before failing


class RunStore:
    """A thin typed layer over the SQLite file; each call is one short transaction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        self._switch_to_wal()
        self._conn.executescript(SCHEMA)

    def _switch_to_wal(self) -> None:
        """Put the file in WAL mode (readers never block the writer). SQLite answers "database is locked" at once,
        without waiting, when the switch meets another connection's write on a file still in rollback mode: two
        processes creating a new store side by side (two searches started together) met it. Wait and retry, as
        the busy timeout does for every other statement."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self._conn.close()

    def create_experiment(self, name: str, description: str, config_yaml: str) -> int:
        cur = self._conn.execute("INSERT INTO experiments (name, description, config, created_at) VALUES (?,?,?,?)",
                                 (name, description, config_yaml, time.time()))
        return _inserted_row(cur)

    def create_trial(self, experiment_id: int, run_dir: Path, hparams: Mapping[str, Any], world_size: int) -> int:
        cur = self._conn.execute(
            "INSERT INTO trials (experiment_id, run_dir, hparams, status, world_size, started_at) VALUES (?,?,?,?,?,?)",
            (experiment_id, str(run_dir), json.dumps(dict(hparams), default=str), "created", world_size, time.time()))
        return _inserted_row(cur)

    def set_run_dir(self, trial_id: int, run_dir: Path) -> None:
        self._conn.execute("UPDATE trials SET run_dir=? WHERE id=?", (str(run_dir), trial_id))

    def set_status(self, trial_id: int, status: str, summary: Mapping[str, Any] | None = None) -> None:
        ended = time.time() if status in ("completed", "failed", "stopped", "interrupted") else None
        self._conn.execute("UPDATE trials SET status=?, ended_at=?, summary=COALESCE(?, summary) WHERE id=?",
                           (status, ended, json.dumps(summary) if summary is not None else None, trial_id))

    def add_metrics(self, trial_id: int, kind: str, rows: Iterable[tuple[int, float | None, float | None,
                                                                         Mapping[str, float]]]) -> None:
        """Insert (step, epoch, wall_seconds, {name: value}) rows of one kind ('training' or 'validation'), all or
        none of them, in one transaction."""
        flat = [(trial_id, kind, step, epoch, wall, name, _stored(float(value)))
                for step, epoch, wall, values in rows for name, value in values.items()]
        if flat:
            with self._transaction():
                self._conn.executemany("INSERT INTO metrics VALUES (?,?,?,?,?,?,?)", flat)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One explicit transaction. The connection is in autocommit mode (isolation_level None), where
        `with connection:` begins nothing: an executemany of N rows was N transactions, each ending with an fsync
        of the write-ahead log (a report of 100 updates: 600 fsyncs and 0.13 s of the writer thread's CPU)."""
        self._conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def experiments(self) -> list[tuple[ExperimentRow, TrialRow | None]]:
        rows = self._conn.execute("SELECT id, name, description, config, created_at FROM experiments ORDER BY id")
        result = []
        for row in rows.fetchall():
            experiment = ExperimentRow(*row)
            trials = self.trials(experiment.id)
            result.append((experiment, trials[-1] if trials else None))
        return result

    def experiment(self, experiment_id: int) -> ExperimentRow | None:
        row = self._conn.execute("SELECT id, name, description, config, created_at FROM experiments WHERE id=?",
                                 (experiment_id,)).fetchone()
        return ExperimentRow(*row) if row else None

    def trials(self, experiment_id: int) -> list[TrialRow]:
        rows = self._conn.execute(
            "SELECT id, experiment_id, run_dir, status, world_size, started_at, ended_at, summary, hparams FROM trials "
            "WHERE experiment_id=? ORDER BY id", (experiment_id,)).fetchall()
        return [TrialRow(id=row[0], experiment_id=row[1], run_dir=row[2], status=row[3], world_size=row[4],
                         started_at=row[5], ended_at=row[6], summary=json.loads(row[7]) if row[7] else None,
                         hparams=json.loads(row[8]) if row[8] else {})
                for row in rows]

    def metric_series(self, trial_id: int, kind: str) -> dict[str, list[tuple[int, float]]]:
        """Every metric of a kind as name -> [(step, value), ...] in step order; a step trained again after a
        restart keeps its newest value."""
        latest: dict[str, dict[int, float]] = {}
        rows = self._conn.execute("SELECT name, step, value FROM metrics WHERE trial_id=? AND kind=? "
                                  "ORDER BY rowid", (trial_id, kind))
        for name, step, value in rows:
            latest.setdefault(name, {})[step] = float(value)  # the text 'NaN' of _stored back to a float
        return {name: sorted(by_step.items()) for name, by_step in sorted(latest.items())}


def _inserted_row(cursor: sqlite3.Cursor) -> int:
    """The id of the row an INSERT just wrote (sqlite3 sets `lastrowid` after every INSERT)."""
    if cursor.lastrowid is None:
        raise RuntimeError("the run store's INSERT left no row id")
    return cursor.lastrowid


def _stored(value: float) -> float | str:
    """A metric value as SQLite can keep it: SQLite binds a NaN as NULL, which `value NOT NULL` refuses (a diverged
    loss failed the whole report and with it the run), so a NaN is kept as the text 'NaN' (a REAL column keeps text
    that is not a number as text; files written before keep their schema). Infinities are REAL values already."""
    return "NaN" if math.isnan(value) else value
