"""`horovod.torch.elastic`: `run`, `State`, `ObjectState`, `TorchState`, `ElasticSampler`."""

from __future__ import annotations

from dtrain.horovod.basics import HorovodInternalError, HostsUpdatedInterrupt
from dtrain.horovod.elastic import ElasticSampler, ObjectState, State, TorchState, run

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]
