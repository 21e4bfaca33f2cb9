"""Per-rank batches for workers of different speed (`distributed.heterogeneous`): the global batch stays fixed and
is cut in proportion to each rank's speed, given as shares or measured (`split: auto`), so that every rank finishes
its share at about the same time instead of the fast ones waiting for the slowest.

Speed is this rank's own work: records over the seconds from the start of a batch (data loading included) to the
moment its last gradient was accumulated in backward, before any wait for the other ranks; a sleep-based straggler
(`faults.slow_rank`) and a CPU quota both show in it. After `calibrate_steps` updates on the even split, and every
`rebalance_every` updates after that, the ranks exchange their median speeds and, when some rank's batch would
change by more than `tolerance`, all take the new split at the same step. The first re-balance cuts in proportion to
the speeds (exact when a batch's time is proportional to its records); once a rank has been timed at two batch sizes,
its time per batch is fitted as t = c + b * n (least squares over every size seen) and the split is the one where every
rank's fitted time is equal. A fixed cost c per batch makes records/s depend on the batch size, so the proportional
split only creeps toward equal finish times, and the `tolerance` gate can stop it short of them (`equal_finish_split`).
The exactness of the update does not
depend on the split: each rank's loss is scaled by world * its share (the contract of dtrain.sync.base), so the
averaged gradient is the full-batch gradient whatever the split (LB-BSP, Chen et al. 2020; pytorch#67253).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dtrain.comm import Topology, all_gather_object
from dtrain.config import ExperimentConfig
from dtrain.data.sharding import BatchSplit, split_by_sizes, split_global_batch
from dtrain.train.callbacks import StepCallback


def proportional_split(global_batch: int, shares: Sequence[float]) -> BatchSplit:
    """`global_batch` records cut in proportion to `shares` (largest remainders; at least one record each)."""
    if global_batch < len(shares):
        raise ValueError(f"a global batch of {global_batch} cannot give {len(shares)} ranks a record each")
    total = float(sum(shares))
    exact = [max(share / total * global_batch, 1.0) for share in shares]
    sizes = [max(int(value), 1) for value in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - sizes[i], reverse=True)
    position = 0
    while sum(sizes) < global_batch:
        sizes[order[position % len(order)]] += 1
        position += 1
    while sum(sizes) > global_batch:  # the floor of one record pushed it over: take from the largest
        sizes[sizes.index(max(sizes))] -= 1
    return split_by_sizes(sizes)


def initial_split(config: ExperimentConfig, world_size: int) -> BatchSplit:
    """The split a run starts with: explicit shares, an even split of exactly the global batch for `auto`, or
    Determined's even split (a remainder dropped) without `distributed.heterogeneous`."""
    het = config.distributed.heterogeneous
    if het is None:
        return split_global_batch(config.global_batch_size, world_size)
    shares = het.split if isinstance(het.split, list) else [1.0] * world_size
    return proportional_split(config.global_batch_size, shares)


FIT_WINDOW = 8  # re-balances whose timings a rank's fit uses: recent enough to follow a rank whose speed changed


def fit_batch_time(samples: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(c, b) of t = c + b * n fitted by least squares to (records n, seconds t) per batch; None unless at least two
    batch sizes were seen and the time grows with the records (b > 0): a noisy fit then falls back to proportions."""
    if len({n for n, _ in samples}) < 2:
        return None
    mean_n = sum(n for n, _ in samples) / len(samples)
    mean_t = sum(t for _, t in samples) / len(samples)
    spread = sum((n - mean_n) ** 2 for n, _ in samples)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in samples) / spread
    if slope <= 0:
        return None
    return mean_t - slope * mean_n, slope


def equal_finish_split(global_batch: int, costs: Sequence[tuple[float, float]]) -> BatchSplit:
    """The split where every rank's t = c + b * n is equal (sum of n = `global_batch`), with at least one record each:
    T = (N + sum c/b) / sum 1/b and n = (T - c) / b over the ranks not held at one record, rounded by largest
    remainders (so each rank is within one record of its exact share)."""
    held: set[int] = set()
    while True:
        free = [r for r in range(len(costs)) if r not in held]
        if not free:
            return proportional_split(global_batch, [1.0] * len(costs))
        records = global_batch - len(held)
        finish = (records + sum(costs[r][0] / costs[r][1] for r in free)) / sum(1 / costs[r][1] for r in free)
        exact = {r: (finish - costs[r][0]) / costs[r][1] for r in free}
        short = {r for r, n in exact.items() if n < 1.0}
        if not short:
            break
        held |= short
    return proportional_split(global_batch, [1.0 if r in held else exact[r] for r in range(len(costs))])


def needs_rebalance(current: Sequence[int], proposed: Sequence[int], tolerance: float) -> bool:
    """True when some rank's batch would change by more than `tolerance` of its current size."""
    return any(abs(new - old) > tolerance * old for old, new in zip(current, proposed, strict=True))


class SpeedMeter(StepCallback):
    """This rank's records per second of its own work: from `before_step` to its last accumulated gradient."""

    def __init__(self, model: nn.Module, records: Callable[[], int]) -> None:
        self.records_per_batch = records
        self.started: float | None = None
        self.last_gradient: float | None = None
        self.records = 0
        self.seconds = 0.0
        self.window: list[float] = []  # records/s of each update since the last take()
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient)
                       for p in model.parameters() if p.requires_grad]

    def _gradient(self, _: torch.Tensor) -> None:
        self.last_gradient = time.perf_counter()

    def before_step(self, step: int) -> None:
        self.started = time.perf_counter()
        self.last_gradient = None

    def after_compute(self, compute_seconds: float) -> None:
        """Count the batch whose backward pass just ended."""
        if self.started is not None and self.last_gradient is not None:
            self.seconds += self.last_gradient - self.started
            self.records += self.records_per_batch()
        self.started = None

    def update_done(self) -> None:
        if self.seconds > 0:
            self.window.append(self.records / self.seconds)
        self.records, self.seconds = 0, 0.0

    def take(self) -> float:
        """The median speed of the updates since the last call (0 when none was timed)."""
        speed = statistics.median(self.window) if self.window else 0.0
        self.window = []
        return speed

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()


class Rebalancer:
    """`split: auto`: decides, on every rank alike, when to move to the split where the ranks finish together (from
    the speeds measured at every split so far: proportional at first, then an affine fit per rank)."""

    def __init__(self, meter: SpeedMeter, topology: Topology, *, global_batch: int, calibrate_steps: int,
                 rebalance_every: int, tolerance: float) -> None:
        self.meter = meter
        self.topology = topology
        self.global_batch = global_batch
        self.calibrate_steps = calibrate_steps
        self.rebalance_every = rebalance_every
        self.tolerance = tolerance
        self.speeds: list[float] = []  # every rank's last measured records/s
        self.timings: list[list[tuple[int, float]]] = []  # per rank: (records, seconds) per batch, last FIT_WINDOW
        self.rebalances = 0

    def due(self, updates: int) -> bool:
        if updates < self.calibrate_steps:
            return False
        return (updates - self.calibrate_steps) % self.rebalance_every == 0

    def after_update(self, updates: int, current: BatchSplit) -> BatchSplit | None:
        """After update number `updates` (counted by every rank alike): the new split when one is due and worth
        it. Collective when due: every rank calls it at every update."""
        self.meter.update_done()
        if not self.due(updates):
            return None
        speeds = [float(s) for s in all_gather_object(self.meter.take())]
        self.speeds = speeds
        if any(speed <= 0 for speed in speeds):
            return None
        proposed = self.propose(current.per_rank, speeds)
        if not needs_rebalance(current.per_rank, proposed.per_rank, self.tolerance):
            return None
        self.rebalances += 1
        return proposed


    def propose(self, current: Sequence[int], speeds: Sequence[float]) -> BatchSplit:
        """The equal-finish split from every rank's fitted t = c + b * n once each has been timed at two batch
        sizes in its last FIT_WINDOW re-balances; otherwise the split proportional to `speeds` (records/s at the
        `current` sizes), whose only fixed point is also the equal-finish split (n ~ n / t means every t is equal),
        so a split that has settled there stays, and a rank whose speed changed moves it again."""
        if not self.timings:
            self.timings = [[] for _ in current]
        for samples, records, speed in zip(self.timings, current, speeds, strict=True):
            samples.append((records, records / speed))
            del samples[:-FIT_WINDOW]
        fits = [fit_batch_time(samples) for samples in self.timings]
        if all(fit is not None for fit in fits):
            return equal_finish_split(self.global_batch, [fit for fit in fits if fit is not None])
        return proportional_split(self.global_batch, speeds)


class FixedSplit:
    """No re-balancing: the split the run started with (an even one, or explicit shares)."""

    speeds: list[float] = []
    rebalances = 0

    def after_update(self, updates: int, current: BatchSplit) -> BatchSplit | None:
        return None


def build_balancing(config: ExperimentConfig, topology: Topology, model: nn.Module, records: Callable[[], int]
                    ) -> tuple[Rebalancer | FixedSplit, SpeedMeter | None]:
    """The re-balancer for `split: auto` in a distributed run (with its speed meter, a step callback), or none."""
    het = config.distributed.heterogeneous
    if het is None or het.split != "auto" or not topology.is_distributed:
        return FixedSplit(), None
    meter = SpeedMeter(model, records)
    return Rebalancer(meter, topology, global_batch=config.global_batch_size, calibrate_steps=het.calibrate_steps,
                      rebalance_every=het.rebalance_every, tolerance=het.tolerance), meter
