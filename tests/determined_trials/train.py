"""A trial in Determined's Trainer-API style: a script that builds the context, the trial and a Trainer, and fits.
`dtrain run trainer.yaml` starts it on every slot (behind Determined's torch_distributed launcher line)."""

from __future__ import annotations

import argparse
import logging

import determined as det
from determined import pytorch
from model_def import RegressionTrial


def main(validate_every: int) -> None:
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    with pytorch.init() as context:
        trial = RegressionTrial(context)
        trainer = pytorch.Trainer(trial, context)
        trainer.fit(max_length=pytorch.Batch(12), validation_period=pytorch.Batch(validate_every),
                    latest_checkpoint=info.latest_checkpoint if info else None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--validate-every", type=int, default=6)
    main(parser.parse_args().validate_every)
