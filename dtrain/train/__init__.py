"""Trial API, Trainer loop, checkpoints and metrics."""
