"""The `horovod` package that `dtrain horovodrun` puts first on PYTHONPATH when the real Horovod is not
installed: `import horovod.torch as hvd` (and `horovod.torch.elastic`, `horovod.torch.compression`) get
dtrain's implementation."""

from __future__ import annotations

import sys

import dtrain.horovod.torch as torch
import dtrain.horovod.torch.compression as _compression
import dtrain.horovod.torch.elastic as _elastic

__version__ = "0.28.1+dtrain"
sys.modules[__name__ + ".torch"] = torch
sys.modules[__name__ + ".torch.elastic"] = _elastic
sys.modules[__name__ + ".torch.compression"] = _compression

__all__ = ["torch"]
