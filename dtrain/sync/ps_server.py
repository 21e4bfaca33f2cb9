"""One parameter-server shard: it holds part of the model and its optimizer, and applies workers' gradients.

Modes (seeds 001 and 003):
- `sync`: an update waits for a gradient from every worker computed on the current parameters and applies their
  mean; with `backup_workers` b it applies the first W-b to arrive, and gradients arriving after their update
  are dropped (counted) - the straggler then continues from the current parameters (Chen et al. 2016).
- `async`: each gradient is applied when it arrives, as its share (1/W) of a global batch's update, so that the W
  gradients of a global batch move the parameters as one synchronous update would, to first order, for any
  optimizer (one worker: exactly plain training). The share (`_apply_share`): the optimizer steps with the gradient
  as if it were the global batch's mean, from the optimizer state the global batch started with, and 1/W of the
  change it makes to the parameters and to its state is kept. Dividing the gradient by W instead holds for plain
  SGD only: Adam normalises the scale away (W full steps per global batch), momentum decays W times. Its staleness
  is the number of updates applied since the worker pulled the parameters it was computed on.
- `ssp` (stale-synchronous, Ho et al. 2013): as async, but the reply that lets a worker start its next step is
  held while the worker's clock (its applied gradients) is more than `staleness` ahead of the slowest worker's.
With `staleness_lr` a gradient of staleness t > 1 is applied with the rate divided by t (Zhang et al. 2016).

The class is plain Python over torch futures, so tests drive it from threads; `dtrain.sync.parameter_server`
exposes it over torch.distributed.rpc.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
from torch.futures import Future

from dtrain.config import ParameterServerMode


@dataclass
class Reply:
    """What a worker gets back for a push (or a pull): the shard's parameters, flattened, and the counters."""

    params: torch.Tensor
    version: int  # updates applied to this shard so far
    global_step: int  # global batches trained: updates (sync) or applied gradients // workers (async, ssp)
    held_seconds: float = 0.0  # time the push waited on this server for other workers


@dataclass
class ShardStats:
    """Counters a run reports: staleness histogram, waiting, bytes in and out, dropped gradients."""

    staleness: Counter[int] = field(default_factory=Counter)
    held_seconds: list[float] = field(default_factory=list)  # per worker
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pushes: int = 0
    dropped: int = 0
    max_clock_gap: int = 0  # largest (clock of a worker starting a step) - (slowest clock) seen

    def to_dict(self) -> dict[str, Any]:
        return {"staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
                "held_seconds_per_worker": list(self.held_seconds), "bytes_pushed": self.bytes_pushed,
                "bytes_pulled": self.bytes_pulled, "pushes": self.pushes, "dropped_gradients": self.dropped,
                "max_clock_gap": self.max_clock_gap}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ShardStats:
        return cls(staleness=Counter({int(k): int(v) for k, v in raw["staleness_histogram"].items()}),
                   held_seconds=[float(x) for x in raw["held_seconds_per_worker"]],
                   bytes_pushed=int(raw["bytes_pushed"]), bytes_pulled=int(raw["bytes_pulled"]),
                   pushes=int(raw["pushes"]), dropped=int(raw["dropped_gradients"]),
                   max_clock_gap=int(raw["max_clock_gap"]))


@dataclass(frozen=True)
class ShardSpec:
    """What a server needs to build its shard: the pieces' initial values, their param groups and the optimizer."""

    pieces: list[torch.Tensor]
    groups: list[int]  # param-group index of each piece
    optimizer_class: type[torch.optim.Optimizer]
    group_options: list[dict[str, Any]]  # each param group's options (everything but `params`)
    layout: list[tuple[int, int, int]]  # (param, start, stop) of each piece: checked when state is loaded


class ShardServer:
    """The parameters and optimizer state of one shard, and the synchronisation rule of the run's mode."""

    def __init__(self, *, workers: int, mode: str = "sync", staleness: int = 0, backup_workers: int = 0,
                 staleness_lr: bool = False) -> None:
        if mode not in get_args(ParameterServerMode):
            raise ValueError(f"mode {mode!r} is not one of {', '.join(get_args(ParameterServerMode))}")
        self.workers = workers
        self.mode = mode
        self.staleness_bound = staleness
        self.needed = workers - backup_workers if mode == "sync" else 1
        self.staleness_lr = staleness_lr
        self.lock = threading.Lock()
        self.version = 0
        self.applied = 0  # gradients applied (async, ssp)
        self.clocks = [0] * workers
        self.paused: set[int] = set()
        self._round: list[tuple[int, torch.Tensor, Future[Reply], float, list[dict[str, Any]]]] = []
        self._held: list[tuple[int, Future[Reply], float]] = []
        # async, ssp: the optimizer state the current global batch (W applied gradients) started from
        self._batch_start: dict[int, dict[str, Any]] = {}
        self.stats = ShardStats(held_seconds=[0.0] * workers)
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.spec: ShardSpec | None = None

    # ------------------------------------------------------------------------------------------- set-up

    @property
    def ready(self) -> bool:
        return self.optimizer is not None

    def setup(self, spec: ShardSpec) -> None:
        """Build the shard (idempotent: every worker may ask, the first one wins)."""
        with self.lock:
            if self.optimizer is not None:
                return
            self.spec = spec
            self.params = [torch.nn.Parameter(p.detach().clone().reshape(-1)) for p in spec.pieces]
            groups = []
            for index, options in enumerate(spec.group_options):
                members = [p for p, g in zip(self.params, spec.groups, strict=True) if g == index]
                if members:
                    groups.append({**options, "params": members, "dtrain_group": index})
            build: Any = spec.optimizer_class  # subclasses take (params, **options)
            self.optimizer = build(groups)

    def state_dict(self) -> dict[str, Any]:
        assert self.optimizer is not None and self.spec is not None
        with self.lock:
            return {"params": [p.detach().clone() for p in self.params], "optimizer": self.optimizer.state_dict(),
                    "version": self.version, "applied": self.applied, "clocks": list(self.clocks),
                    "stats": self.stats.to_dict(), "layout": self.spec.layout,
                    "batch_start": [_copy_state(self._batch_start.get(id(p), {})) for p in self.params]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None and self.spec is not None
        if [tuple(x) for x in state["layout"]] != [tuple(x) for x in self.spec.layout]:
            raise ValueError("the checkpoint's parameter shards do not match this run's (another number of servers "
                             "or another model)")
        with self.lock:
            with torch.no_grad():
                for param, saved in zip(self.params, state["params"], strict=True):
                    param.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])
            self.version, self.applied = int(state["version"]), int(state["applied"])
            self.clocks = [int(c) for c in state["clocks"]]
            self.stats = ShardStats.from_dict(state["stats"])
            saved = state.get("batch_start")  # absent from checkpoints of earlier versions: start a global batch
            self._batch_start = ({id(p): _copy_state(entry) for p, entry in zip(self.params, saved, strict=True)}
                                 if saved is not None else self._optimizer_state())

    # ------------------------------------------------------------------------------------ push and pull

    def pull(self) -> Reply:
        with self.lock:
            reply = self._reply()
            self.stats.bytes_pulled += reply.params.numel() * reply.params.element_size()
            return reply

    def push(self, worker: int, grad: torch.Tensor, pulled_version: int,
             options: list[dict[str, Any]]) -> Future[Reply]:
        """Hand in `worker`'s gradient for this shard, computed on parameters of `pulled_version`; the future
        completes with the parameters the worker's next step starts from, when the mode lets it start."""
        arrival = time.perf_counter()
        future: Future[Reply] = Future()
        done: list[tuple[Future[Reply], Reply]] = []
        with self.lock:
            assert self.optimizer is not None, "setup() first"
            self.stats.bytes_pushed += grad.numel() * grad.element_size()
            self.stats.pushes += 1
            staleness = self.version - pulled_version
            if self.mode == "sync":
                if staleness > 0:  # its update happened without it: drop it, continue from the current parameters
                    self.stats.dropped += 1
                    done.append((future, self._reply(arrival, worker)))
                else:
                    self._round.append((worker, grad, future, arrival, options))
                    if len(self._round) >= self.needed:
                        done += self._apply_round()
            else:
                self.stats.staleness[staleness] += 1
                self._apply_share(grad, options, staleness)
                self.applied += 1
                self.clocks[worker] += 1
                if self.mode == "async":
                    done.append((future, self._reply(arrival, worker)))
                else:
                    self._held.append((worker, future, arrival))
                    done += self._release_held()
        for waiting, reply in done:
            waiting.set_result(reply)
        return future

    def pause(self, worker: int) -> None:
        """`worker` waits at a meeting of all workers (validation, checkpoint): the ssp rule stops counting it, so
        that the others can reach the meeting too."""
        with self.lock:
            self.paused.add(worker)
            done = self._release_held()
        for waiting, reply in done:
            waiting.set_result(reply)

    def resume(self, worker: int) -> None:
        with self.lock:
            self.paused.discard(worker)

    # ------------------------------------------------------------------------------------------ internals

    def _apply_round(self) -> list[tuple[Future[Reply], Reply]]:
        entries = sorted(self._round, key=lambda entry: entry[0])  # a fixed order: reproducible sums
        self._round = []
        mean = torch.stack([entry[1] for entry in entries]).sum(dim=0) / len(entries)
        self.stats.staleness[0] += len(entries)
        self._apply(mean, entries[0][4], 0)
        return [(future, self._reply(arrival, worker)) for worker, _, future, arrival, _ in entries]

    def _apply(self, flat: torch.Tensor, options: list[dict[str, Any]], staleness: int) -> None:
        """One optimizer step with the flat gradient `flat` and the workers' current param-group options."""
        assert self.optimizer is not None
        offset = 0
        for param in self.params:
            param.grad = flat[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
        for group in self.optimizer.param_groups:
            index = group["dtrain_group"] if "dtrain_group" in group else 0
            if index < len(options):
                for key, value in options[index].items():
                    group[key] = value
            if self.staleness_lr and staleness > 1:
                group["lr"] = group["lr"] / staleness
        self.optimizer.step()
        self.version += 1

    def _apply_share(self, grad: torch.Tensor, options: list[dict[str, Any]], staleness: int) -> None:
        """Apply one worker's gradient as its 1/W share of a global batch's update (async, ssp): an optimizer step
        with `grad` as if it were the global batch's mean gradient, taken from the optimizer state the global batch
        started with, of which 1/W of the change to the parameters and to the optimizer state is kept. The W shares
        of a global batch add up to the mean of the W updates, which equals the update of the mean gradient to first
        order in the gradients' spread (exactly for SGD, and for the linear state, Adam's first moment, momentum);
        an optimizer's step counter advances by 1/W a share, one a global batch, and every share is corrected
        (Adam's bias correction) as the batch's one step."""
        assert self.optimizer is not None
        if self.workers == 1:
            self._apply(grad, options, staleness)
            return
        before = [param.detach().clone() for param in self.params]
        current = self._optimizer_state()
        for param in self.params:  # the step starts from the global batch's starting state
            self.optimizer.state[param] = _copy_state(self._batch_start.get(id(param), {}))
        self._apply(grad, options, staleness)
        with torch.no_grad():
            for param, old in zip(self.params, before, strict=True):
                param.copy_(old + (param - old) / self.workers)
        for param in self.params:
            stepped, start, now = self.optimizer.state[param], self._batch_start.get(id(param), {}), current.get(
                id(param), {})
            self.optimizer.state[param] = {key: _share(now.get(key), start.get(key), value, self.workers)
                                           for key, value in stepped.items()}
        if (self.applied + 1) % self.workers == 0:  # this gradient ends a global batch
            self._batch_start = self._optimizer_state()

    def _optimizer_state(self) -> dict[int, dict[str, Any]]:
        """A copy of the optimizer's state, by parameter id."""
        assert self.optimizer is not None
        return {id(param): _copy_state(self.optimizer.state.get(param, {})) for param in self.params}

    def _release_held(self) -> list[tuple[Future[Reply], Reply]]:
        active = [c for w, c in enumerate(self.clocks) if w not in self.paused]
        slowest = min(active) if active else min(self.clocks)
        released, kept = [], []
        for worker, future, arrival in self._held:
            gap = self.clocks[worker] - slowest
            if gap <= self.staleness_bound:
                self.stats.max_clock_gap = max(self.stats.max_clock_gap, gap)
                released.append((future, self._reply(arrival, worker)))
            else:
                kept.append((worker, future, arrival))
        self._held = kept
        return released

    def _global_step(self) -> int:
        return self.version if self.mode == "sync" else self.applied // self.workers

    def _reply(self, arrival: float | None = None, worker: int | None = None) -> Reply:
        held = time.perf_counter() - arrival if arrival is not None else 0.0
        if worker is not None:
            self.stats.held_seconds[worker] += held
        params = torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params else torch.zeros(0)
        if worker is not None:
            self.stats.bytes_pulled += params.numel() * params.element_size()
        return Reply(params=params, version=self.version, global_step=self._global_step(), held_seconds=held)


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _share(now: Any, start: Any, stepped: Any, workers: int) -> Any:
    """An optimizer state entry after one share: `now` moved by 1/W of the change one full step made from `start`
    (an entry the optimizer creates on its first step starts from zero, as Adam's moments do and as SGD's momentum
    buffer, a copy of the first gradient, averages to the batch's mean). Entries that are not numbers are kept."""
    numeric = isinstance(stepped, torch.Tensor) and stepped.is_floating_point() or isinstance(stepped, float)
    if not numeric:
        return stepped
    base = 0.0 if start is None else start
    return (0.0 if now is None else now) + (stepped - base) / workers
