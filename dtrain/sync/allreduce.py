"""Synchronous data parallelism by all-reduce: torch DDP's C++ reducer buckets gradients and overlaps their
communication with the rest of the backward pass; dtrain decides what a bucket's communication is (average,
sum or Adasum, through `hooks.combine_bucket`) and how big buckets are (fixed, or tuned while training).

With op `average` and no compressor the reducer's own C++ all-reduce runs (no Python in the communication);
any other op, a compressor or a profiler timeline that wants a span per bucket registers dtrain's comm hook.
Every replica applies the same combined gradient, so the replicas stay identical.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import re
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from dtrain.comm import Topology
from dtrain.comm.collectives import collective_device
from dtrain.comm.failures import is_unfinished_reduction
from dtrain.compress import Compressor, NoCompression, WireStats, build_compressor
from dtrain.config import ExperimentConfig
from dtrain.config import ReduceOp as Op
from dtrain.errors import SyncError
from dtrain.sync.base import StrategyBase
from dtrain.sync.fusion import BYTES_PER_MB, FusionTuner, candidate_bucket_sizes
from dtrain.sync.hooks import (
    BucketObserver,
    HookState,
    ObservedHookState,
    combine_bucket,
    observed_combine_bucket,
)
from dtrain.sync.spec import StrategySpec

log = logging.getLogger(__name__)

_UNUSED = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def unfinished_reduction_error(exc: RuntimeError, names: list[str]) -> SyncError | None:
    """DDP's error for parameters that got no gradient (their bucket's all-reduce never started on this
    rank, so the other ranks would wait for it) as one line that names them and says what to set."""
    if not is_unfinished_reduction(exc):
        return None
    found = _UNUSED.search(str(exc))
    unused = [names[int(i)] for i in found.group(2).split() if int(i) < len(names)] if found else []
    which = f" ({', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''})" if unused else ""
    return SyncError(f"model parameters got no gradient in this step{which}, so their all-reduce never ran on "
                     "this rank and the other ranks would wait for it; set `distributed.find_unused_parameters: "
                     "true` for models whose forward pass skips parameters")



def ddp_version_arguments(caps: list[float], *, init_sync: bool) -> dict[str, Any]:
    """The DistributedDataParallel arguments dtrain passes that not every supported torch takes, where the installed
    one takes them (by its signature): `bucket_cap_mb_list` (torch PR 169026; without it `bucket_cap_mb` = the
    larger cap, and the first bucket is DDP's fixed 1 MiB one), `batched_grad_copy` (PR 176638; without it one copy
    per gradient) and `init_sync` (PR 142824; without it a rebuilt wrapper broadcasts rank 0's identical
    weights once more)."""
    accepted = _ddp_parameters()
    arguments: dict[str, Any] = ({"bucket_cap_mb_list": caps} if "bucket_cap_mb_list" in accepted
                                 else {"bucket_cap_mb": caps[-1]})
    if "batched_grad_copy" in accepted:
        arguments["batched_grad_copy"] = True
    if "init_sync" in accepted:
        arguments["init_sync"] = init_sync
    return arguments


@functools.cache
def _ddp_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


class Replica(nn.Module):
    """The module the Trainer runs: it forwards to the current DDP wrapper, which fusion tuning replaces."""

    def __init__(self, ddp: DistributedDataParallel, names: list[str]) -> None:
        super().__init__()
        self.ddp = ddp
        self.parameter_names = names

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.ddp(*args, **kwargs)
        except RuntimeError as exc:
            raise unfinished_reduction_error(exc, self.parameter_names) or exc from None

    def check_reduction_finished(self) -> None:
        """Raise SyncError at once if a parameter got no gradient in the backward pass that just ran."""
        try:
            self.ddp._check_reducer_finalized()
        except RuntimeError as exc:
            raise unfinished_reduction_error(exc, self.parameter_names) or exc from None


class AllReduceStrategy(StrategyBase):
    """DDP with buckets of `bucket_cap_mb` (or tuned ones) and the comm hook for `op`; with one process the
    model runs unwrapped (nothing to synchronize). The core protocol, with `observe_buckets` and `take_wire_stats`
    of its own, plus the Consolidating extension (a fresh DDP wrapper at each checkpoint, for bitwise-identical
    restarts) (dtrain.sync.base)."""

    name = "allreduce"

    def __init__(self, topology: Topology, *, op: Op = "average", bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0,
                 auto_tune_fusion: bool = False, find_unused_parameters: bool = False,
                 compressor: Compressor | None = None, tuner_steps_per_visit: int = 6,
                 tuner_rounds: int = 3, tuner_warmup_steps: int = 5) -> None:
        self.topology = topology
        self.op: Op = op
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.auto_tune_fusion = auto_tune_fusion
        self.find_unused_parameters = find_unused_parameters
        self.compressor: Compressor = compressor or NoCompression()
        self._wire = WireStats()  # what this rank sent: counted by the comm hook, or in step() without it
        self._hooked = False
        self._gradient_bytes = 0
        self._tuner_settings = (tuner_steps_per_visit, tuner_rounds, tuner_warmup_steps)
        self.tuner: FusionTuner | None = None
        self._tuning_restored: dict[str, Any] | None = None
        self._model: nn.Module | None = None
        self._replica: Replica | None = None
        self._last_step_end: float | None = None
        self._observer: BucketObserver | None = None
        self._observe_per_bucket = False
        self._gradient_hooks: list[torch.utils.hooks.RemovableHandle] = []

    # ------------------------------------------------------------------------------- core protocol

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._model = model
        if not self.topology.is_distributed:
            return model
        if self.auto_tune_fusion and self._tuning_restored is None:
            model_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / BYTES_PER_MB
            candidates = candidate_bucket_sizes(model_mb, self.bucket_cap_mb)
            if len(candidates) > 1:
                steps, rounds, warmup = self._tuner_settings
                self.tuner = FusionTuner(candidates, steps_per_visit=steps, rounds=rounds, warmup_steps=warmup)
                self.bucket_cap_mb = self.tuner.current
        names = [name for name, p in model.named_parameters() if p.requires_grad]  # DDP's parameter indices
        self._gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._replica = Replica(self._build_ddp(model, init_sync=True), names)
        if self._observer is not None and not self._hooked:
            self._observe_gradients(self._observer)
        return self._replica

    def unwrap_model(self) -> nn.Module:
        assert self._model is not None, "wrap_model() first"
        return self._model

    def no_sync(self) -> AbstractContextManager[Any]:
        if self._replica is not None:
            return self._replica.ddp.no_sync()
        return nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._replica is not None:
            self._replica.check_reduction_finished()
            if not self._hooked:  # the reducer's own all-reduce ran: count its dense bytes
                self._wire.record_uncompressed(self._gradient_bytes, self.topology.world_size)
        optimizer.step()
        if self.tuner is not None and not self.tuner.done:
            self._tune_step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"bucket_cap_mb": self.bucket_cap_mb, "compressor": self.compressor.state_dict()}
        if self.tuner is not None:
            state["fusion_tuning"] = self.tuner.state_dict()
        elif self._tuning_restored is not None:
            state["fusion_tuning"] = self._tuning_restored
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume with the bucket size a finished tuning chose (an unfinished one starts again)."""
        self.compressor.load_state_dict(state.get("compressor", {}))
        tuning = state.get("fusion_tuning")
        if tuning is not None and tuning.get("done"):
            self._tuning_restored = tuning
            self.bucket_cap_mb = float(state["bucket_cap_mb"])

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.name, "op": self.op, "bucket_cap_mb": self.bucket_cap_mb,
                                "first_bucket_mb": min(self.first_bucket_mb, self.bucket_cap_mb),
                                "auto_tune_tensor_fusion": self.auto_tune_fusion,
                                "compression": self.compressor.describe()}
        tuning = self.state_dict().get("fusion_tuning")
        if tuning is not None:
            info["fusion_tuning"] = {**tuning, "restored": self.tuner is None}
        return info

    def close(self) -> None:
        self._replica = None

    # ---------------------------------------------------------------------------------- extensions

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Before a checkpoint (`snapshot`), with 3 or more ranks: build the DDP wrapper anew, so that the next step
        runs with DDP's initial bucket layout, as the first step of a run resumed from this checkpoint will.

        DDP reduces its first iteration with buckets in reverse parameter order and then rebuilds them in the order
        gradients became ready. The layout decides where gloo's ring cuts the flat buffer into per-rank chunks, and
        so the order in which each element's sum is accumulated; with 3 or more ranks float addition is not
        associative, and a resumed run would differ from an uninterrupted one in the last bits from its first step
        on. Replicas never differ, so validation needs nothing."""
        if snapshot and self._replica is not None and self.topology.world_size > 2 and not self.find_unused_parameters:
            self._switch_bucket_size(self.bucket_cap_mb)

    def take_wire_stats(self) -> WireStats | None:
        """Bytes this rank sent since the last call (None with one process: nothing is sent)."""
        return self._wire.take() if self._replica is not None else None

    def observe_buckets(self, observer: BucketObserver | None, *, per_bucket: bool = False) -> None:
        """Tell `observer` (the profiler's bucket clock) when gradients are ready for communication. Where
        dtrain's comm hook runs anyway, and with `per_bucket` (a timeline's bucket spans), it reports each
        bucket's ready and done times, so a plain average then goes through the comm hook too (decided by
        wrap_model: call before it); otherwise a hook on each parameter's gradient accumulation reports when
        it is ready, and DDP's own C++ all-reduce keeps running. None stops the parameter hooks."""
        for handle in self._gradient_hooks:
            handle.remove()
        self._gradient_hooks = []
        self._observer = observer
        self._observe_per_bucket = per_bucket
        if observer is not None and self._replica is not None and not self._hooked:
            self._observe_gradients(observer)

    def _observe_gradients(self, observer: BucketObserver) -> None:
        """Report the time of every gradient accumulated in a backward pass that communicates (not under
        no_sync): the last one is when the rank's own work was done and its wait for the others began."""
        assert self._model is not None

        def ready(_: torch.Tensor) -> None:
            if self._replica is not None and self._replica.ddp.require_backward_grad_sync:
                observer.gradient_ready()

        self._gradient_hooks = [parameter.register_post_accumulate_grad_hook(ready)
                                for parameter in self._model.parameters() if parameter.requires_grad]

    def join(self) -> AbstractContextManager[Any]:
        """For loops where ranks run different numbers of steps (not used by the Trainer): a rank that ran out of
        data keeps answering the others' all-reduces with zero gradients until every rank is done."""
        if self._replica is not None:
            return Join([self._replica.ddp])
        return nullcontext()

    # ------------------------------------------------------------------------------------- internals

    def _build_ddp(self, model: nn.Module, *, init_sync: bool) -> DistributedDataParallel:
        """Gradients live in the buckets (no copy back) and are copied in one batched op per bucket."""
        device_ids = [self.topology.device.index] if self.topology.device.type == "cuda" else None
        # A per-bucket cap list [first, rest] gives DDP's default layout (a small first bucket, so the last layers'
        # all-reduce starts while backward goes on) with any bucket size; a plain bucket_cap_mb would make the
        # first bucket as large as the others.
        caps = [min(self.first_bucket_mb, self.bucket_cap_mb), self.bucket_cap_mb]
        ddp = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=self.find_unused_parameters,
                                      gradient_as_bucket_view=True,
                                      **ddp_version_arguments(caps, init_sync=init_sync))
        self._hooked = self._register_hook(ddp, model)
        return ddp

    def _register_hook(self, ddp: DistributedDataParallel, model: nn.Module) -> bool:
        """Register dtrain's comm hook where DDP's own all-reduce will not do; True when one is registered (a
        subclass may register another hook: `hierarchical`)."""
        # A timeline's bucket spans need a hook even for a plain average (dtrain's hook then does what DDP's
        # built-in all-reduce does, and times each bucket).
        hooked = ((self._observer is not None and self._observe_per_bucket) or self.op != "average"
                  or not isinstance(self.compressor, NoCompression))
        if hooked:
            trainable = [p for p in model.parameters() if p.requires_grad]
            positions = {id(p): index / max(len(trainable) - 1, 1) for index, p in enumerate(trainable)}
            state = HookState(self.op, compressor=self.compressor, parameter_positions=positions, wire=self._wire)
            if self._observer is not None:
                ddp.register_comm_hook(ObservedHookState(state, self._observer), observed_combine_bucket)
            else:
                ddp.register_comm_hook(state, combine_bucket)
        return hooked

    def _tune_step(self) -> None:
        """Time the step that just ended; at the end of a visit agree on its time and move to the next size."""
        assert self.tuner is not None and self._replica is not None and self._model is not None
        now = time.perf_counter()
        # the very first step has no start time; it is a warm-up step, which observe() does not time
        self.tuner.observe(now - self._last_step_end if self._last_step_end is not None else float("nan"))
        if self.tuner.visit_complete():
            reduced = torch.tensor([self.tuner.local_median()], dtype=torch.float64, device=collective_device())
            dist.all_reduce(reduced)
            previous = self.tuner.current
            self.tuner.finish_visit(float(reduced.item()) / self.topology.world_size)
            if self.tuner.done:
                log.info(self.tuner.report())
            if self.tuner.current != previous:
                self._switch_bucket_size(self.tuner.current)
        self._last_step_end = time.perf_counter()

    def _switch_bucket_size(self, bucket_cap_mb: float) -> None:
        """Replace the DDP wrapper by one with other buckets; replicas are identical, so no initial sync."""
        assert self._replica is not None and self._model is not None
        for parameter in self._model.parameters():
            parameter.grad = None  # they may be views of the old wrapper's buckets
        # the DDP wrapper is dropped once the strategy is closed
        self._replica.ddp = None  # type: ignore[assignment]
        gc.collect()  # the old reducer removes its autograd hooks when it is freed
        self.bucket_cap_mb = bucket_cap_mb
        self._replica.ddp = self._build_ddp(self._model, init_sync=False)


def build_allreduce(config: ExperimentConfig, topology: Topology) -> AllReduceStrategy:
    """The strategy from the config's `distributed`, `optimizations` and `compression` sections."""
    return AllReduceStrategy(topology, op=config.distributed.op,
                             bucket_cap_mb=config.optimizations.tensor_fusion_threshold,
                             first_bucket_mb=config.optimizations.first_bucket_mb,
                             auto_tune_fusion=config.optimizations.auto_tune_tensor_fusion,
                             find_unused_parameters=config.distributed.find_unused_parameters,
                             compressor=build_compressor(config.compression.name, **config.compression.options()))


SPEC = StrategySpec("allreduce", build_allreduce)
