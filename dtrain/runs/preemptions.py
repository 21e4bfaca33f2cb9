"""What each preemption of a run cost, kept in its run dir (`preemptions.jsonl`, one line per preemption, written
by `dtrain run` on the chief before it requeues the job) and copied into `summary.json` when the run ends: the
seconds from the preemption's signal to the checkpoint on disk, and the batches the resumed run does again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PREEMPTIONS_FILE = "preemptions.jsonl"


def record_preemption(run_dir: Path, job: str, signalled_at: float | None, signal: str | None = None) -> dict[str, Any]:
    """Append this preemption: the job, the signal that stopped the workers (SIGTERM, SIGUSR1), when it was sent
    (`signalled_at`, epoch seconds: Slurm's PreemptTime, whole seconds as scontrol gives them, or when rank 0
    received it), the checkpoint the workers left (`checkpoints/latest`) and when it was complete on disk. A
    checkpoint from before the signal means the batches after it are done again: their number is unknown here
    (None); one written after it is the batch the workers stopped at, so nothing is redone."""
    latest = run_dir / "checkpoints" / "latest"
    entry: dict[str, Any] = {"job": job, "signal": signal, "signalled_at": signalled_at, "checkpoint": None,
                             "seconds_to_checkpoint": None, "batches_redone": None}
    if latest.is_file():
        written = latest.stat().st_mtime
        entry["checkpoint"] = latest.read_text().strip()
        if signalled_at is not None:
            entry["seconds_to_checkpoint"] = round(written - signalled_at, 1)
            entry["batches_redone"] = 0 if written >= signalled_at else None
    with (run_dir / PREEMPTIONS_FILE).open("a") as out:
        out.write(json.dumps(entry) + "\n")
    return entry


def read_preemptions(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / PREEMPTIONS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def describe_preemptions(found: list[dict[str, Any]]) -> str:
    """`N (S1 s, S2 s, ... from the signal to the checkpoint on disk; R batches redone)` for the summary's lines."""
    seconds = ", ".join("?" if p["seconds_to_checkpoint"] is None else f"{p['seconds_to_checkpoint']:.1f} s"
                        for p in found)
    redone = [p["batches_redone"] for p in found]
    lost = "unknown" if None in redone else str(sum(redone))
    return f"{len(found)} ({seconds} from the signal to the checkpoint on disk; {lost} batches redone)"
