"""`determined.keras`: TensorFlow/Keras trials are not supported by dtrain (PyTorch only)."""

raise ImportError("determined.keras (TFKerasTrial) is not available: dtrain trains PyTorch models only; port the "
                  "model to a determined.pytorch.PyTorchTrial or a dtrain.Trial (docs/determined.md)")
