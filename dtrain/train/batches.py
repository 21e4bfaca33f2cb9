"""What the Trainer does with data: checks on what the Trial returns, this rank's share of every batch through the
batch-size phases (the one place the per-rank split changes), and the stream of this rank's training batches."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from dtrain.comm import Topology, all_gather_object
from dtrain.data.arrays import keep_batch
from dtrain.data.sharding import BatchSplit, ShardedBatchSampler, pass_sizes
from dtrain.errors import SyncError, TrialError
from dtrain.optim.batch_schedule import BatchPhase, BatchPlan


class SizedDataset(Protocol):
    """A map-style dataset: what the Trainer needs from the Trial's data."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def check_dataset(data: Any, where: str) -> SizedDataset:
    """The Trial's dataset, if it is a non-empty map-style one; TrialError otherwise."""
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise TrialError(f"{where}() returned {type(data).__name__}; return a map-style torch Dataset "
                         "(with __len__ and __getitem__)")
    if len(data) == 0:
        raise TrialError(f"{where}() returned an empty dataset")
    return data


def returns_batches(data: SizedDataset) -> bool:
    """True for a dataset that hands out whole batches (`__getitems__`, collated already)."""
    return bool(getattr(data, "returns_batches", False))


def check_same_data_on_all_ranks(train: SizedDataset, validation: SizedDataset, topology: Topology) -> None:
    """Ranks must agree on the data's size, or one would run out of batches first and the others would wait
    for it forever; say so at once instead."""
    if not topology.is_distributed:
        return
    sizes = all_gather_object((len(train), len(validation)))
    if len(set(sizes)) > 1:
        shown = ", ".join(f"rank {rank}: {records} training / {held_out} validation records"
                          for rank, (records, held_out) in enumerate(sizes))
        raise SyncError(f"the ranks built datasets of different sizes ({shown}); every rank must build the "
                        "same (whole) dataset - dtrain shards it - so that all ranks run the same steps")


def move_to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Tensors anywhere inside tuples, lists and dicts, moved to `device` (a no-op on the CPU); with
    `channels_last`, 4-D floating tensors (image batches) are laid out NHWC for faster convolutions."""
    if device.type == "cpu" and not channels_last:
        return batch
    if isinstance(batch, torch.Tensor):
        moved = batch if device.type == "cpu" else batch.to(device, non_blocking=True)
        if channels_last and moved.dim() == 4 and moved.is_floating_point():
            moved = moved.contiguous(memory_format=torch.channels_last)
        return moved
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device, channels_last) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device, channels_last) for key, value in batch.items()}
    return batch


def batch_length(batch: Any) -> int:
    """Records in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_length(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_length(next(iter(batch.values())))
    raise TrialError(f"cannot tell how many records a batch of type {type(batch).__name__} holds; "
                     "return tensors, or tuples/dicts of tensors, from the dataset")


def metric_value(name: str, value: Any, where: str) -> float:
    """A metric the Trial returned, as a float; TrialError unless it is a scalar tensor or a number."""
    return float(metric_term(name, value, where))


def metric_term(name: str, value: Any, where: str) -> torch.Tensor | float:
    """A metric the Trial returned, checked but not read: a float64 scalar tensor where it lives (reading a tensor
    on a GPU waits for the device), or a float; TrialError unless it is a scalar tensor or a number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TrialError(f"{where} returned `{name}` with shape {tuple(value.shape)}; return a scalar (a mean "
                             "over the batch)")
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, (int, float)):
        return float(value)
    raise TrialError(f"{where} returned `{name}` of type {type(value).__name__}; return tensors or floats")


class BatchSizes:
    """This rank's share of every batch: the configured split multiplied by the current batch-size phase, and the
    factor its backward passes scale the loss by (world * this rank's share of the global batch, / k when
    aggregated gradients are averaged: the contract in dtrain.sync.base)."""

    def __init__(self, base: BatchSplit, *, rank: int, world_size: int, average_aggregated: bool,
                 max_per_pass: int | None = None) -> None:
        self.base = base
        self.max_per_pass = max_per_pass  # optimizations.max_per_slot_batch
        self.rank = rank
        self.world_size = world_size
        self.average_aggregated = average_aggregated
        self.split = base
        self.records = base.per_rank[rank]  # this rank's records per batch in the current phase
        self.phase: BatchPhase | None = None
        self.aggregation_frequency = 1  # of the current phase
        self.loss_scale = 1.0
        self.pass_records: tuple[int, ...] = (self.records,)  # this rank's batch as the passes that train it

    def split_of(self, phase: BatchPhase) -> BatchSplit:
        """The configured per-rank batches multiplied by the phase's multiplier."""
        times = phase.batch_multiplier
        return BatchSplit(per_rank=tuple(size * times for size in self.base.per_rank),
                          requested_global=self.base.requested_global * times)

    def passes_of(self, phase: BatchPhase) -> int:
        """Forward/backward passes this rank trains each batch of `phase` in: one, or as many as keep every pass
        within `max_per_pass` records."""
        records = self.split_of(phase).per_rank[self.rank]
        return 1 if self.max_per_pass is None else -(-records // self.max_per_pass)

    def rebase(self, base: BatchSplit) -> None:
        """Cut every batch by `base` from now on (re-balancing: the global batch is the same), in the same phase."""
        self.base = base
        phase, self.phase = self.phase, None
        if phase is not None:
            self.enter(phase)

    def enter(self, phase: BatchPhase) -> bool:
        """Train the next batches with `phase`'s split and aggregation; True when that is a change."""
        if phase is self.phase:
            return False
        self.phase = phase
        self.aggregation_frequency = phase.aggregation_frequency
        self.split = self.split_of(phase)
        self.records = self.split.per_rank[self.rank]
        self.pass_records = pass_sizes(self.records, self.passes_of(phase))
        self.loss_scale = self.world_size * self.split.weight(self.rank)
        if self.average_aggregated:
            self.loss_scale /= phase.aggregation_frequency
        return True


class TrainingBatches:
    """This rank's training batches, phase after phase, each phase's split from its place in the data and a fresh
    shuffle at every pass (the same walk for a run that resumed at any step); a batch trained in several passes
    (`BatchSizes.pass_records`) comes as that many parts."""

    def __init__(self, data: SizedDataset, plan: BatchPlan, sizes: BatchSizes, *, seed: int, num_workers: int,
                 pin_memory: bool) -> None:
        self.data = data
        self.plan = plan
        self.sizes = sizes
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    def starting_at(self, step: int) -> Iterator[Any]:
        """The batches after batch `step`."""
        while True:
            phase = self.plan.phase_at(step)
            end = self.plan.phase_end(phase)
            passes = self.sizes.passes_of(phase)
            batches = self._phase_batches(self.sizes.split_of(phase), *self.plan.position_at(step), passes=passes)
            if end is None:
                yield from batches
                return
            yield from itertools.islice(batches, (end - step) * passes)
            step = end

    def _phase_batches(self, split: BatchSplit, data_pass: int, offset: int, *, passes: int) -> Iterator[Any]:
        """Batches of one split from (pass, record offset) on, crossing epoch boundaries with a fresh shuffle each;
        each of this rank's batches as `passes` parts."""
        sampler = ShardedBatchSampler(len(self.data), split, self.sizes.rank, self.seed, data_pass,
                                      start_record=offset, passes=passes)
        collate = keep_batch if returns_batches(self.data) else None
        loader: DataLoader[Any] = DataLoader(
            # SizedDataset is the protocol of what DataLoader uses; torch's stub asks for its Dataset class
            self.data, batch_sampler=sampler, num_workers=self.num_workers, collate_fn=collate,  # type: ignore[arg-type]
            persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(self.seed))
        while True:
            yield from loader
            sampler.epoch += 1
            sampler.start_record = 0
