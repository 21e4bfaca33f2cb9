"""Trial API, Trainer loop, checkpoints, run dirs and metrics."""
