"""A Core API script that sets its own length (`--batches N`), as Determined's command-entrypoint examples do
(`python3 train.py --epochs 1`): it never asks the searcher for a length, it reports validation metrics as it
goes, and the searcher counts the steps it reports."""

from __future__ import annotations

import argparse

import determined as det

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, required=True)
    args = parser.parse_args()
    with det.core.init() as core:
        info = det.get_cluster_info()
        assert info is not None, "run this under `dtrain run own_length_search.yaml`"
        rate = float(info.trial.hparams["rate"])
        loss = 10.0
        for batch in range(args.batches):
            loss *= 1.0 - rate
            core.train.report_validation_metrics(steps_completed=batch + 1, metrics={"validation_loss": loss})
