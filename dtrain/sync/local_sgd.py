"""The local SGD family (`distributed.strategy: local_sgd`): every rank steps on its own gradients and the
replicas meet every `period` updates.

- local SGD (Stich 2019; Lin et al. 2018): average the parameters every H updates;
- post-local SGD (Lin et al. 2018): the first `warmup_steps` updates are synchronous (gradients all-reduced
  every update, as strategy `allreduce`), local SGD after them;
- hierarchical periods: during local SGD the gradients are still averaged inside each node every update, and the
  nodes' replicas are averaged every H (cheap links every step, the slow one every H);
- DiLoCo (Douillard et al. 2023): the inner optimizer (the Trainer's) runs H updates, then the averaged
  pseudo-gradient  delta = theta_last_round - theta_local  feeds an outer SGD (Nesterov) step from theta_last_round.
  With outer lr 1 and momentum 0 that is exactly periodic averaging (the test that guards the sign, torchft #233).

The counter that decides when to average advances once per `step()`, never per parameter group (the bug of
pytorch/pytorch#74157, which made post-local SGD lose 7 points). The averaged values (parameters or
pseudo-gradients) go through dtrain's compressors (`distributed.compression`) like gradient buckets do.

Gradients reach the model through DDP with a comm hook, so the synchronous phase keeps DDP's buckets and overlap;
during local phases the hook returns the bucket untouched (or averages it inside the node). The Trainer's loss
scaling (world * share) still holds: a rank's scaled local gradient, averaged over ranks, is the full-batch one.

Replicas differ between rounds, so the strategy is `Consolidating`: a validation or checkpoint is an averaging
round (an outer step for DiLoCo), the same on every rank. Momentum and other inner-optimizer state stay local, so
the strategy owns its checkpoint state (`OwnsCheckpointState`): a checkpoint holds every rank's optimizer state and
each rank resumes from its own (a resumed run ends bitwise where an uninterrupted one does); the outer optimizer's
state is saved with the strategy's.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at registration as real objects.

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm import Topology, all_gather_object
from dtrain.comm.topology import NodeGroups, node_groups
from dtrain.compress import BucketInfo, Compressor, NoCompression, WireStats, build_compressor
from dtrain.config import ExperimentConfig
from dtrain.sync.base import StrategyBase
from dtrain.sync.hooks import run_round
from dtrain.sync.spec import StrategySpec


@dataclass
class LocalHookState:
    """What the comm hook does with a ready bucket: all-reduce it over every rank (synchronous phase), inside the
    node only (`node` set, local phase with node_sync) or nothing (local phase)."""

    world_size: int
    synchronous: bool = True
    node: NodeGroups | None = None
    wire: WireStats = field(default_factory=WireStats)


def local_sgd_hook(state: LocalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks the current phase synchronizes (sum, then divide: gloo's AVG is not
    trusted, pytorch/pytorch#162338), or hand it back unchanged."""
    buffer = bucket.buffer()
    if state.synchronous:
        group, size = None, state.world_size
    elif state.node is not None and state.node.local_size > 1:
        group, size = state.node.local, state.node.local_size
    else:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    state.wire.record_uncompressed(buffer.numel() * buffer.element_size(), size)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda _: buffer.div_(size))


class LocalSGDStrategy(StrategyBase):
    """Local SGD, post-local SGD, hierarchical periods and DiLoCo behind the core protocol, plus `Consolidating`,
    `take_wire_stats`, `metrics` and `OwnsCheckpointState` (dtrain.sync.base)."""

    name = "local_sgd"

    def __init__(self, topology: Topology, *, period: int = 8, warmup_steps: int = 0, node_sync: bool = False,
                 average_buffers: bool = True, outer_optimizer: str = "none", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, compressor: Compressor | None = None) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self.topology = topology
        self.period = period
        self.warmup_steps = warmup_steps
        self.node_sync = node_sync
        self.average_buffers = average_buffers
        self.outer_name = outer_optimizer
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.compressor: Compressor = compressor or NoCompression()
        self.updates = 0  # optimizer updates applied (once per step(), whatever the number of parameter groups)
        self.local_updates = 0  # local updates since the last averaging round
        self.rounds = 0  # averaging rounds (outer steps) so far
        self.synchronous_updates = 0  # updates whose gradients were all-reduced over every rank
        self._model: nn.Module | None = None
        self._ddp: DistributedDataParallel | None = None
        self._hook = LocalHookState(world_size=topology.world_size)
        self._wire = self._hook.wire
        self._global: list[torch.Tensor] = []  # DiLoCo: the parameters of the last round (the outer optimizer's)
        self._outer: torch.optim.Optimizer | None = None
        self._outer_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------- core protocol

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._model = model
        if not self.topology.is_distributed:
            return model
        if self.node_sync:
            self._hook.node = node_groups(self.topology)
        self._hook.synchronous = self.updates < self.warmup_steps
        self._ddp = DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
        self._ddp.register_comm_hook(self._hook, local_sgd_hook)
        if self.outer_name != "none":
            self._global = [p.detach().clone() for p in self._parameters()]
            for copy in self._global:
                copy.requires_grad_(True)
            self._outer = torch.optim.SGD(self._global, lr=self.outer_lr, momentum=self.outer_momentum,
                                          nesterov=self.outer_name == "nesterov" and self.outer_momentum > 0)
            if self._outer_state is not None:
                self._outer.load_state_dict(self._outer_state)
        return self._ddp

    def unwrap_model(self) -> nn.Module:
        assert self._model is not None, "wrap_model() first"
        return self._model

    def no_sync(self) -> AbstractContextManager[Any]:
        return self._ddp.no_sync() if self._ddp is not None else nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner update; then, once per call (not per parameter group), count it and average when due."""
        if self._outer is not None and not self._hook.synchronous and self.local_updates == 0:
            with torch.no_grad():  # a local period starts from the parameters every rank shares now
                for old, p in zip(self._global, self._parameters(), strict=True):
                    old.copy_(p)
        optimizer.step()
        if self._ddp is None:
            return
        if self._hook.synchronous:
            self.synchronous_updates += 1
        else:
            self.local_updates += 1
        self.updates += 1
        if not self._hook.synchronous and self.local_updates >= self.period:
            self._average()
        self._hook.synchronous = self.updates < self.warmup_steps

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"updates": self.updates, "rounds": self.rounds,
                                 "synchronous_updates": self.synchronous_updates,
                                 "compressor": self.compressor.state_dict()}
        if self._outer is not None:
            state["outer"] = self._outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the counters (the warm-up is not run again) and the outer optimizer's momentum."""
        self.updates = int(state.get("updates", 0))
        self.rounds = int(state.get("rounds", 0))
        self.synchronous_updates = int(state.get("synchronous_updates", 0))
        self.compressor.load_state_dict(state.get("compressor", {}))
        self._outer_state = state.get("outer")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "period": self.period, "warmup_steps": self.warmup_steps,
                "node_sync": self.node_sync, "average_buffers": self.average_buffers,
                "outer_optimizer": {"name": self.outer_name, "lr": self.outer_lr, "momentum": self.outer_momentum}
                if self.outer_name != "none" else None,
                "compression": self.compressor.describe(), "updates": self.updates,
                "synchronous_updates": self.synchronous_updates, "averaging_rounds": self.rounds}

    def close(self) -> None:
        self._ddp = None

    # ---------------------------------------------------------------------------------- extensions

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Before validation and checkpoints: an averaging round, unless the replicas are identical already
        (no local update since the last round)."""
        if self._ddp is not None and self.local_updates > 0:
            self._average()

    def model_state_dict(self) -> dict[str, Any]:
        """The model (the same on every rank: a checkpoint is an averaging round first)."""
        return self.unwrap_model().state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrap_model().load_state_dict(state)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every rank's inner-optimizer state, in rank order (momentum differs between ranks after local steps)."""
        return {"per_rank": all_gather_object(optimizer.state_dict())}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """This rank's own state; a checkpoint from another world size (or a plain one) gives every rank the first."""
        per_rank = state.get("per_rank")
        if per_rank is None:
            optimizer.load_state_dict(state)
            return
        own = per_rank[self.topology.rank] if len(per_rank) == self.topology.world_size else per_rank[0]
        optimizer.load_state_dict(own)

    def take_wire_stats(self) -> WireStats | None:
        return self._wire.take() if self._ddp is not None else None

    def metrics(self) -> dict[str, float]:
        return {"averaging_rounds": float(self.rounds), "synchronous_updates": float(self.synchronous_updates)}

    # ------------------------------------------------------------------------------------- internals

    def _parameters(self) -> list[torch.Tensor]:
        assert self._model is not None
        return [p for p in self._model.parameters() if p.requires_grad]

    def _buffers(self) -> list[torch.Tensor]:
        assert self._model is not None
        return [b for b in self._model.buffers() if b.is_floating_point()] if self.average_buffers else []

    def _average(self) -> None:
        """One round: plain averaging of the parameters, or DiLoCo's outer step on the averaged pseudo-gradient;
        floating buffers are averaged either way (when `average_buffers`)."""
        parameters = self._parameters()
        with torch.no_grad():
            if self._outer is None:
                self._all_average(parameters + self._buffers())
            else:
                # the pseudo-gradient points downhill like a gradient: theta_last_round - theta_local
                deltas = [old - p for old, p in zip(self._global, parameters, strict=True)]
                self._all_average(deltas + self._buffers())
                for old, delta in zip(self._global, deltas, strict=True):
                    old.grad = delta
                self._outer.step()
                for old, p in zip(self._global, parameters, strict=True):
                    old.grad = None
                    p.copy_(old)
        self.local_updates = 0
        self.rounds += 1

    def _all_average(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over all ranks, in one flat message through the compressor."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        world = self.topology.world_size
        info = BucketInfo.single(flat, key=-1, world_size=world, rank=self.topology.rank, divisor=world,
                                 shapes=[t.shape for t in tensors])
        self._wire.record_bucket(flat.numel() * flat.element_size(), world)
        first = self.compressor.compress(flat, info)
        decoded = self.compressor.decompress(run_round(first, None, self._wire).wait(), first.ctx)
        while (further := decoded.next_round) is not None:
            decoded = self.compressor.decompress(run_round(further, None, self._wire).wait(), further.ctx)
        self.compressor.state.end_bucket(info)
        averaged = decoded.gradient
        assert averaged is not None
        offset = 0
        for t in tensors:
            t.copy_(averaged[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def build_local_sgd(config: ExperimentConfig, topology: Topology) -> LocalSGDStrategy:
    """The strategy from `distributed.local_sgd` and `distributed.compression`."""
    settings = config.distributed.local_sgd
    return LocalSGDStrategy(topology, period=settings.period, warmup_steps=settings.warmup_steps,
                            node_sync=settings.node_sync, average_buffers=settings.average_buffers,
                            outer_optimizer=settings.outer_optimizer, outer_lr=settings.outer_lr,
                            outer_momentum=settings.outer_momentum,
                            compressor=build_compressor(config.compression.name, **config.compression.options()))


def local_sgd_summary(described: Mapping[str, Any]) -> str:
    """The run summary's `sync` line: how often the replicas met and how, not an op (local SGD averages
    parameters, or DiLoCo's pseudo-gradients, not gradients)."""
    outer = described.get("outer_optimizer")
    how = (f"an outer {outer['name']} step (lr {outer['lr']:g}, momentum {outer['momentum']:g})" if outer
           else "parameters averaged")
    compression = described.get("compression") or {}
    name = compression.get("name") if isinstance(compression, Mapping) else None
    text = (f"local_sgd, every {described.get('period')} updates {how}: {described.get('averaging_rounds')} "
            f"averaging rounds, {described.get('synchronous_updates')} of {described.get('updates')} updates "
            "synchronous")
    if described.get("node_sync"):
        text += ", gradients averaged inside each node every update"
    return text + (f", compression {name}" if name and name != "none" else "")


SPEC = StrategySpec("local_sgd", build_local_sgd, summary=local_sgd_summary,
                    cannot_resize="local SGD and DiLoCo average replicas that each trained `period` updates on its "
                    "own share with its own optimizer state: the trajectory depends on the number of workers")
