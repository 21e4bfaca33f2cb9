"""Named exceptions that callers catch; each carries one user-facing line: the value, the rule, the fix."""

from __future__ import annotations


class DtrainError(Exception):
    """Base of every error that is the user's to fix; the CLI prints it as one line, without a traceback."""

    exit_code = 2


class ConfigError(DtrainError):
    """The experiment config (YAML file or --set override) breaks a rule."""


class DataError(DtrainError):
    """A data file is missing, truncated or not what its name says."""


class CheckpointError(DtrainError):
    """A checkpoint is missing, corrupt or does not belong to this run."""


class TrialError(DtrainError):
    """The user's Trial class cannot be found or does not honour the Trial API."""


class TrainingDiverged(DtrainError):
    """The training loss became NaN or infinite: the recipe (learning rate, warm-up, optimizer) needs changing."""


class LaunchError(DtrainError):
    """Workers could not be started or a run dir cannot be used."""


class SyncError(DtrainError):
    """Ranks cannot stay in step: a parameter without gradient, ranks that disagree on the data or schedule."""


class StallError(DtrainError):
    """A collective waited longer than `distributed.timeout_seconds`: names the ranks that did not arrive."""

    exit_code = 1


class TorchCompatibilityError(DtrainError):
    """The installed torch lacks a private torch API dtrain relies on (renamed or removed in another release)."""
