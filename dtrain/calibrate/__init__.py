"""Measure this machine for the performance model: `calibrate` (compute and all-reduce timings, kept as a
calibration file) and `measure` (a model's parameters and FLOPs, from a torch module or an experiment's
Trial). Both import torch; the model itself, in dtrain.plan, does not."""
