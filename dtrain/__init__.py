"""dtrain: distributed training of PyTorch models on torch.distributed.

User code subclasses `dtrain.Trial`; everything else is driven by an experiment YAML and `dtrain run`.
Names are imported lazily so that `python -m dtrain.worker` can answer quickly before torch loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Trial", "TrialContext", "__version__"]

if TYPE_CHECKING:
    from dtrain.train.trial import Trial, TrialContext


def __getattr__(name: str) -> Any:
    if name in ("Trial", "TrialContext"):
        from dtrain.train import trial

        return getattr(trial, name)
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
