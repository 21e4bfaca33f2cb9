"""A stop advisor: something outside the Trainer that may stop a run after a validation, such as the searcher of
a hyperparameter search (adaptive ASHA's rungs, an Optuna pruner). The Trainer asks it on the chief only and
passes the answer to every rank, so all ranks stop at the same batch, with a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class StopAdvisor(Protocol):
    def after_validation(self, units: Mapping[str, float], metric: float | None) -> str | None:
        """Called on the chief after each validation with the training done so far (`batches`, `records`,
        `epochs`) and the searcher metric; None to go on, or the reason to stop."""
