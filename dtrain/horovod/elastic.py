"""`hvd.elastic`: training that survives a lost worker and follows a changing number of workers.

Under `dtrain horovodrun --min-np/--max-np` (the elastic driver, `elastic_driver.py`) it works as Horovod's does,
inside the surviving processes: a collective that breaks because a peer died raises on the survivors, which roll
the state back to the last `commit()`, re-form the process group at the new size (`basics.reform`), call the reset
callbacks, sync the state from the new rank 0 and run the function again, with `hvd.size()` answering the new
size. When the driver has taken in more workers (the host discovery script reported more slots), `commit()`
raises `HostsUpdatedInterrupt` on every rank together and the job re-forms larger at that commit.

Under torchrun's restarts instead (`--reset-limit N` without `--min-np/--max-np`) every worker is restarted at the
same size; `commit()` then also writes the committed state to disk (rank 0, atomically) and the restarted
`@hvd.elastic.run` function loads it before the first `sync()`.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain.horovod import basics, membership, state
from dtrain.horovod.basics import HorovodInternalError, HostsUpdatedInterrupt


def state_file() -> Path:
    """Where the committed state lives across restarts: $DTRAIN_HOROVOD_STATE_DIR (set by `dtrain horovodrun`)
    or a directory named after torchrun's run id."""
    folder = os.environ.get("DTRAIN_HOROVOD_STATE_DIR") or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"dtrain-horovod-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")
    return Path(folder) / "elastic-state.pt"


class State:
    """What `hvd.elastic.run` keeps consistent: `save`/`restore`/`sync`, `commit`, reset callbacks."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Remember the state as the point to return to after a failure (in memory; on rank 0 also on disk when
        the job restarts through torchrun), then check whether the job's membership changed."""
        self.save()
        if basics.rank() == 0 and not membership.active():
            path = state_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            torch.save(self._payload(), partial)
            os.replace(partial, path)
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank together when the elastic driver has announced a newer
        membership (rank 0 reads it and broadcasts it, so all ranks decide alike). Under torchrun's restarts
        the hosts are fixed within an attempt."""
        if not membership.active():
            return
        newest = torch.tensor([membership.latest_generation() if basics.rank() == 0 else -1])
        dist.broadcast(newest, 0)
        if int(newest) > membership.current_generation():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def _payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, payload: dict[str, Any]) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values (given as keyword arguments, read and written as attributes), synced from rank 0."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        super().__init__()
        self._bcast = bcast_object or state.broadcast_object
        self._rank = get_rank or basics.rank
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self) -> None:
        if self._names:
            for name, value in self._bcast(self._values(), 0, name="ObjectState").items():
                setattr(self, name, value)
            self.save()

    def _payload(self) -> dict[str, Any]:
        return {"objects": self._saved}

    def _load(self, payload: dict[str, Any]) -> None:
        self._saved = payload["objects"]
        self.restore()


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Shards a dataset over the current ranks and remembers how far the epoch got (`record_batch`), so that a
    restarted or resized job does not repeat or skip samples within the epoch."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def reset(self) -> None:
        self.num_replicas = basics.size()
        self.rank = basics.rank()
        remaining = len(self.dataset) - self.processed_num
        self.num_samples = int(math.ceil(max(remaining, 0) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (call at the end of each epoch, as Horovod's examples do)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: list[int]) -> None:
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, values: dict[str, int]) -> None:
        self.epoch = values["epoch"]
        self.processed_num = values["processed_num"]
        self.reset()

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            indices = list(range(len(self.dataset)))
        indices = indices[self.processed_num:]
        if indices:
            indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain values: the model's and optimizer's state are broadcast from
    rank 0 on `sync()`, kept as deep copies on `save()`/`commit()`, and written to disk on `commit()`."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._samplers = {name: value for name, value in kwargs.items() if isinstance(value, ElasticSampler)}
        plain = {name: value for name, value in kwargs.items() if name not in self._samplers}
        for name, sampler in self._samplers.items():
            object.__setattr__(self, name, sampler)
        self._torch_saved: dict[str, Any] = {}
        super().__init__(**plain)

    def save(self) -> None:
        super().save()
        self._torch_saved = {
            "model": copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "samplers": {name: s.state_dict() for name, s in self._samplers.items()}}

    def restore(self) -> None:
        super().restore()
        saved = self._torch_saved
        if self.model is not None and saved.get("model") is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and saved.get("optimizer") is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name, values in saved.get("samplers", {}).items():
            self._samplers[name].load_state_dict(values)

    def sync(self) -> None:
        # the optimizer first: a worker that joins with no optimizer state takes a zero-gradient step to create
        # it, which may move its weights (weight decay); the parameters broadcast after it overwrite them
        if self.optimizer is not None:
            state.broadcast_optimizer_state(self.optimizer, root_rank=0)
        if self.model is not None:
            state.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self._samplers:
            positions = state.broadcast_object({n: s.state_dict() for n, s in self._samplers.items()}, 0,
                                               name="ElasticSampler")
            for name, values in positions.items():
                self._samplers[name].load_state_dict(values)
        super().sync()

    def _payload(self) -> dict[str, Any]:
        return {**super()._payload(), "torch": self._torch_saved}

    def _load(self, payload: dict[str, Any]) -> None:
        self._torch_saved = payload["torch"]
        super()._load(payload)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `train(state, ...)`: sync the state from rank 0 and run it. On a failed collective
    (`HorovodInternalError`, or gloo's error when a peer is gone) roll back to the last commit; on
    `HostsUpdatedInterrupt` keep the state; then, under the elastic driver, re-form the job at its new size, call
    the reset callbacks and run again. Under torchrun's restarts the last commit written to disk is loaded
    first."""

    @functools.wraps(func)
    def wrapper(elastic_state: State, *args: Any, **kwargs: Any) -> Any:
        if not basics.is_initialized():
            basics.init()
        path = state_file()
        if not membership.active() and basics.rank() == 0 and path.is_file():
            elastic_state._load(torch.load(path, weights_only=False))
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    elastic_state.sync()
                return func(elastic_state, *args, **kwargs)
            except HorovodInternalError:
                elastic_state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            except RuntimeError as error:
                if not (membership.active() and membership.is_collective_failure(error)):
                    raise
                elastic_state.restore()
                skip_sync = False
            if membership.active():
                try:
                    basics.reform()
                except membership.RemovedFromJob:
                    raise SystemExit(0) from None
            elastic_state.on_reset()

    return wrapper
