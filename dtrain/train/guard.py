"""Decisions every rank must take together at each optimizer update: apply it or skip it (non-finite
gradients, `nan_policy`), and stop or go on (a SIGINT/SIGTERM that reached any rank).

Both come from one small exchange of per-rank flags before the optimizer step, so a NaN that only one
rank sees (after the gradients were synchronized) or a signal that reached one rank first still leads
every rank to the same choice, and the replicas never drift apart. Where every rank is on this host with a core
of its own, the flags go through a shared-memory all-gather (`dtrain.comm.shm`): a gloo all-reduce of them cost
about 1 ms per update on the 2-core build machine (its work thread and transport loop hand the message on), a
second rendezvous per step that the hand-written DDP loop does not have (issue 22).
"""

from __future__ import annotations

import hashlib
import math
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import torch

from dtrain.comm import rank_flags
from dtrain.comm.shm import ShmAllGather
from dtrain.errors import TrainingDiverged

RECIPE_ADVICE = ("lower the learning rate (large_batch.base_lr or the Trial's), warm it up (large_batch.warmup_epochs) "
                 "or use large_batch.optimizer lars or lamb")


@dataclass(frozen=True)
class Verdict:
    """What all ranks do with this update."""

    apply: bool
    stop: bool
    nonfinite_ranks: tuple[int, ...] = ()
    overflow: bool = False  # fp16: the loss scaler's shared verdict says skip (the update drops its gradients)


def gradients_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """True when no gradient holds a NaN or an infinity. A NaN or infinity anywhere makes the plain sum of all
    gradients non-finite, and that sum is one cheap pass (an inf-norm took 5x as long, a fifth of a small
    model's step); only a non-finite sum, which large finite values can also give by overflowing, is checked
    element by element."""
    return update_flags(parameters)[0]


def update_flags(parameters: Iterable[torch.nn.Parameter],
                 overflow: torch.Tensor | None = None) -> tuple[bool, bool]:
    """(gradients finite, fp16 overflow) for this update, in one read from the device: fp16's `overflow` verdict
    (0-d, 1 = skip) rides with the gradients' sum, and an update that overflowed reads as finite (its gradients are
    dropped, not judged)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and overflow is None:
        return True, False
    total = torch.stack([grad.sum() for grad in grads]).sum() if grads else None
    if overflow is None:
        assert total is not None
        total_value = float(total)
    else:
        pair = [overflow.reshape(()).to(torch.float64)]
        if total is not None:  # a sharded gradient's sum (a DTensor) is made whole, as float() would make it
            whole = total.full_tensor() if hasattr(total, "full_tensor") else total
            pair.append(whole.to(device=overflow.device, dtype=torch.float64))
        values = torch.stack(pair).tolist()
        if values[0] > 0:
            return True, True
        total_value = values[1] if total is not None else 0.0
    if math.isfinite(total_value):
        return True, False
    return all(bool(torch.isfinite(grad).all()) for grad in grads), False


def model_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter, in model order (equal on ranks that hold the same weights). Buffers are left
    out: batch-norm running statistics are each rank's own between DDP's broadcasts at every forward pass (the
    last training forward updates them from each rank's own batch), and checkpoints hold rank 0's. A sharded
    parameter (a DTensor, strategy fsdp) is gathered whole one at a time: a collective, every rank calls this
    together, and no rank holds more than one whole parameter for it."""
    digest = hashlib.sha256()
    for name, tensor in model.named_parameters():
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode())
        digest.update(whole.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class GracefulStop:
    """While active, SIGINT, SIGTERM and SIGUSR1 only ask the loop to stop at the next update (after a checkpoint);
    SIGUSR1 is the checkpoint-and-requeue request under Slurm (`scancel --signal=USR1`, `--signal=[B:]USR1@N`).
    A second SIGINT or SIGTERM, a second or more later, interrupts at once (KeyboardInterrupt); a repeated SIGUSR1
    (scancel's and the agent's copy of one request) is only the same request again."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # wall clock (epoch seconds) of the first signal
        self._first_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self._first_at, self.received_at = signal.Signals(signum), time.monotonic(), time.time()
        elif signum != signal.SIGUSR1 and time.monotonic() - self._first_at > 1.0:
            raise KeyboardInterrupt

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class UpdateGuard:
    """Applies `nan_policy` (abort | skip, at most `max_consecutive` skips in a row) and the stop request."""

    def __init__(self, policy: str, max_consecutive: int, stop: GracefulStop, skipped: int = 0,
                 collective: bool = True, rank: int = 0, exchange: ShmAllGather | None = None) -> None:
        """`exchange`: a same-host shared-memory all-gather of 2 numbers per rank that carries the flags instead of
        gloo (`dtrain.comm.shm.setup_allgather`), for a collective guard."""
        self.policy = policy
        self.rank = rank
        self.collective = collective  # False where ranks do not move in lockstep (asynchronous parameter servers)
        self.exchange = exchange if collective else None
        self._table = np.zeros((self.exchange.layout.world, 2)) if self.exchange is not None else None
        self.max_consecutive = max_consecutive
        self.stop = stop
        self.skipped = skipped  # updates skipped in the whole run (carried by checkpoints)
        self.in_a_row = 0

    def decide(self, step: int, parameters: Iterable[torch.nn.Parameter],
               overflow: torch.Tensor | None = None) -> Verdict:
        """The same verdict on every rank for the update after batch `step` (one collective). Where ranks do not
        move in lockstep a collective per update would pair different batches, so each rank decides for its own
        gradient; a stop request then waits for the next meeting point (report, validation, checkpoint).
        `overflow`: fp16's loss-scaler verdict, already the same on every rank; an overflow is not a non-finite
        gradient under `nan_policy` (the scaler lowers its scale and the update is skipped: `Verdict.overflow`)."""
        finite, overflowed = update_flags(parameters, overflow)
        mine = [not finite, self.stop.requested]
        flags = self._every_ranks(mine) if self.collective else [mine]
        ranks = range(len(flags)) if self.collective else [self.rank]
        bad = tuple(rank for rank, (nonfinite, _) in zip(ranks, flags, strict=True) if nonfinite)
        stop = any(requested for _, requested in flags)
        if not bad:
            self.in_a_row = 0
            return Verdict(apply=True, stop=stop, overflow=overflowed)
        where = f"batch {step}: the gradient on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} is " \
                "not finite (NaN or infinity)"
        if self.policy == "abort":
            raise TrainingDiverged(f"training diverged: {where}; the update was not applied (nan_policy abort) and "
                                   f"training up to the latest checkpoint is kept; {RECIPE_ADVICE}, or set nan_policy: "
                                   "skip to skip such updates")
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row > self.max_consecutive:
            raise TrainingDiverged(f"training diverged: {where}, {self.in_a_row} updates in a row, more than "
                                   f"max_consecutive_nan_skips ({self.max_consecutive}); training up to the latest "
                                   f"checkpoint is kept; {RECIPE_ADVICE}, or check the data of these batches")
        return Verdict(apply=False, stop=stop, nonfinite_ranks=bad)

    def _every_ranks(self, mine: list[bool]) -> list[tuple[bool, ...]]:
        """Every rank's flags in rank order, through the shared-memory exchange where there is one."""
        if self.exchange is None or self._table is None:
            return rank_flags(mine)
        table = self.exchange.gather(np.array(mine, dtype=np.float64), self._table)
        return [tuple(bool(value) for value in row) for row in table]

    def close(self) -> None:
        """Unmap the shared-memory exchange (at the end of training; the guard decides nothing afterwards)."""
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
