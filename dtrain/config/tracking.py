"""The `tracking` section: an experiment tracker a run also logs to, beside the run store and TensorBoard. MLflow is
the one offered (`pip install 'dtrain[mlflow]'`); `dtrain.train.tracking` does the logging, on rank 0, from a
thread of its own."""

from __future__ import annotations

import os

from pydantic import Field

from dtrain.config.base import Section


class MlflowTracking(Section):
    """A run logged to MLflow as Lightning's MLFlowLogger and the transformers MLflowCallback log one: the config
    (`config.yaml` artifact), the hyperparameters (params), the training and validation metrics at every report,
    and where the checkpoints are (tags). A search's trials are child runs of the search's run."""

    tracking_uri: str | None = Field(
        default=None, description="the MLflow tracking server (`http://host:5000`) or a database store "
        "(`sqlite:///mlflow.db`; MLflow 3 refuses its old `file:` store); unset: the environment's "
        "`MLFLOW_TRACKING_URI`")
    experiment_name: str | None = Field(
        default=None, description="the MLflow experiment (made when missing); unset: the environment's "
        "`MLFLOW_EXPERIMENT_NAME`, else the experiment's `name`")
    run_name: str | None = Field(default=None, description="the MLflow run's name; unset: the experiment's `name` "
                                                            "and the run dir's name (a search's trial: `trial-<n>`)")
    tags: dict[str, str] = Field(default_factory=dict, description="tags set on the run (and on a search's run)")
    parent_run_id: str | None = Field(
        default=None, description="log the run as a child of this MLflow run (a search sets it for its trials to the "
        "search's run)")

    def uri(self) -> str | None:
        """The tracking URI: the section's, else MLFLOW_TRACKING_URI; None when neither is given."""
        return self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None

    def experiment(self, default: str) -> str:
        """The MLflow experiment's name: the section's, else MLFLOW_EXPERIMENT_NAME, else `default`."""
        return self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or default


class Tracking(Section):
    """Experiment trackers the run logs to besides dtrain's own store and TensorBoard (none by default)."""

    mlflow: MlflowTracking | None = Field(
        default=None, description="log to MLflow (`pip install 'dtrain[mlflow]'`); `mlflow: {}` takes the server "
        "from `MLFLOW_TRACKING_URI`")
