"""Named exceptions that callers catch, and the exit codes of `dtrain` and its workers (defined only here).

Each exception carries one user-facing line: the value, the rule, the fix.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """How `dtrain` and a worker process end; scripts and the elastic agent read these numbers."""

    OK = 0  # training finished (or the command did what it was asked)
    FAILED = 1  # workers failed: a crash, a lost worker, a stalled collective
    USER_ERROR = 2  # a config, data, checkpoint, Trial or command-line error, or a diverged run
    STOPPED = 3  # training stopped early (e.g. faults.stop_after_batch); resumable
    INVALID_HP = 4  # the Trial rejected its hyperparameters (InvalidHP); a search moves on to the next trial
    INTERRUPTED = 130  # Ctrl-C or SIGTERM (128 + SIGINT, as shells report it); resumable


class DtrainError(Exception):
    """Base of every error that is the user's to fix; the CLI prints it as one line, without a traceback."""

    exit_code: ExitCode = ExitCode.USER_ERROR


class ConfigError(DtrainError):
    """The experiment config (YAML file or --set override) breaks a rule."""


class DataError(DtrainError):
    """A data file is missing, truncated or not what its name says."""


class CheckpointError(DtrainError):
    """A checkpoint is missing, corrupt or does not belong to this run."""


class TrialError(DtrainError):
    """The user's Trial class cannot be found or does not honour the Trial API."""


class InvalidHP(DtrainError):
    """A Trial rejects the combination of hyperparameters it was given (Determined's `InvalidHP`).

    Raised from a Trial's code; the run ends with exit code 4 and a search records the trial as invalid and
    draws the next one instead of failing.
    """

    exit_code = ExitCode.INVALID_HP


class TrainingDiverged(DtrainError):
    """The training loss became NaN or infinite: the recipe (learning rate, warm-up, optimizer) needs changing."""


class LaunchError(DtrainError):
    """Workers could not be started or a run dir cannot be used."""


class SyncError(DtrainError):
    """Ranks cannot stay in step: a parameter without gradient, ranks that disagree on the data or schedule."""


class StallError(DtrainError):
    """A collective waited longer than `distributed.timeout_seconds`: names the ranks that did not arrive."""

    exit_code = ExitCode.FAILED


class PlanError(DtrainError):
    """`dtrain plan` was given inputs it cannot use."""


class CalibrationError(DtrainError):
    """The calibration file is missing, unreadable or from another format, or a calibration measurement failed."""


class DiagnoseError(DtrainError):
    """A `dtrain diagnose` trial failed."""


class TorchCompatibilityError(DtrainError):
    """The installed torch lacks a private torch API dtrain relies on (renamed or removed in another release)."""
