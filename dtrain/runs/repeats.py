"""Exceptions raised by a worker's user code, recorded per attempt, so that one that comes back ends the run.

A restart resumes from the latest checkpoint; an exception in the Trial's own code (a bug, a wrong shape) then
meets the same line at the same batch again, and further restarts only repeat it. A worker records each such
exception in `logs/exception-rank-N.json`; when the attempt before this one (any rank) recorded the same one
— same type, same innermost user frame (file:line), same number of batches done — the run is over. The
record also holds the user's frames of the traceback, which is all the console shows of it.
"""

from __future__ import annotations

import json
import os
import sysconfig
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from dtrain.runs.fatal import launch_id

EXCEPTION_FILE = "exception-rank-{rank}.json"  # under the run dir's logs/
_DTRAIN_DIR = os.path.realpath(Path(__file__).resolve().parents[1])


@dataclass(frozen=True)
class UserException:
    """One exception a worker met, where it met it, and the user's part of its traceback."""

    kind: str  # the exception's type, e.g. KeyError
    message: str  # the first line of its message
    where: str  # file:line of the innermost user frame (or of the innermost frame when no frame is the user's)
    function: str  # the function of that frame
    batches_done: int | None  # batches trained when it was raised; None before training started
    rank: int
    attempt: int  # the agent's restart count (TORCHELASTIC_RESTART_COUNT)
    launch: str  # launch_id(): records of an earlier launch never match
    traceback: str  # "Traceback ...", the user's frames, and the exception's last line
    user_code: bool = True  # False when no frame of the traceback is the user's (dtrain's or torch's own error)

    def same_as(self, other: UserException) -> bool:
        """Same type, same place, same batch: what a restart from the latest checkpoint will meet again."""
        return (self.kind, self.where, self.batches_done) == (other.kind, other.where, other.batches_done)

    def describe(self) -> str:
        """One line: the exception, where, and when."""
        file, _, line = self.where.rpartition(":")
        when = f" after {self.batches_done} batches" if self.batches_done is not None else " before training"
        return f"{self.kind}: {self.message} in {self.function} ({Path(file).name}:{line}){when}"


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {_DTRAIN_DIR, *(os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return tuple(sorted(found))


def is_user_file(filename: str, libraries: tuple[str, ...] | None = None) -> bool:
    """Whether a frame's file is the user's: not dtrain's, not an installed package's, not Python's own."""
    if filename.startswith("<"):  # <frozen runpy>, <string>
        return False
    real = os.path.realpath(filename)
    return not any(real == lib or real.startswith(lib + os.sep) for lib in libraries or _library_dirs())


def describe_exception(exc: BaseException, *, rank: int, attempt: int, batches_done: int | None,
                       libraries: tuple[str, ...] | None = None) -> UserException:
    """The record of `exc`: its innermost user frame, and a traceback of the user's frames only."""
    frames = traceback.extract_tb(exc.__traceback__)
    users = [frame for frame in frames if is_user_file(frame.filename, libraries)]
    shown = users or list(frames)
    last = shown[-1] if shown else None
    head = "Traceback (most recent call last; the user's frames only):" if users else \
        "Traceback (most recent call last):"
    text = head + "\n" + "".join(traceback.format_list(shown)) + "".join(traceback.format_exception_only(exc))
    lines = str(exc).strip().splitlines()
    return UserException(kind=type(exc).__name__, message=lines[0][:300] if lines else "",
                         where=f"{last.filename}:{last.lineno}" if last else "?", function=last.name if last else "?",
                         batches_done=batches_done, rank=rank, attempt=attempt, launch=launch_id(),
                         traceback=text.rstrip("\n"), user_code=bool(users))


def _read(path: Path) -> UserException | None:
    try:
        return UserException(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def recorded(run_dir: Path, launch: str, attempt: int) -> list[UserException]:
    """The exceptions that the workers of attempt `attempt` of `launch` recorded, by rank."""
    found = (_read(path) for path in sorted((run_dir / "logs").glob(EXCEPTION_FILE.format(rank="*"))))
    return sorted((e for e in found if e is not None and e.launch == launch and e.attempt == attempt),
                  key=lambda e: e.rank)


def record_exception(run_dir: Path, found: UserException) -> UserException | None:
    """Record `found` for its rank; return the same exception recorded by the attempt before (any rank), if any
    and if it was raised in user code: then a restart met it again and the next one would too. An error with no
    user frame (torch's or dtrain's own, e.g. after a peer was killed at the same batch again) is left to the
    restarts."""
    earlier = recorded(run_dir, found.launch, found.attempt - 1) if found.user_code else []
    repeated = next((e for e in earlier if e.same_as(found)), None)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / EXCEPTION_FILE.format(rank=found.rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(found)))
    tmp.replace(path)
    return repeated
