"""The one collective of an SMO iteration: every rank's two candidates, packed in one float64 all-gather.

Each rank proposes its local extremes (the sample of I_up with the smallest f, the sample of I_low with the
largest f; or the `slots` most extreme of each side for a larger working set) together with everything the
other ranks need to update with them: the global index, alpha, label, box bound C_i, K(x, x) and the sample's
features. One `all_gather_single` (an all-gather into one tensor) then gives every rank the same table, from
which each picks the same global working pair (the min/max-location reduction) and has both samples' data
(the owners' broadcast) without a second message.

The all-gather goes through gloo, or, when every rank is on this host with a core of its own, through a
shared-memory segment (`dtrain.comm.shm`; `exchange: auto | gloo | shm`): on the 2-core build machine a gloo
all-gather of this size costs ~1 ms and the shared-memory one a few microseconds, against an iteration's
~0.1 ms of work. Both give the same bytes, so the solve is the same either way.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from dtrain.comm.shm import ShmAllGather, setup_allgather

# Fields of one candidate row, followed by the sample's features.
F, INDEX, ALPHA, LABEL, BOUND, KDIAG = range(6)
FIELDS = 6


class PairExchange:
    """Packs this rank's candidates into a preallocated buffer and all-gathers them; times the collective.

    A rank sends `slots` candidates per side: rows [0, slots) are its I_up candidates (smallest f first),
    rows [slots, 2 slots) its I_low candidates (largest f first); each row is FIELDS numbers and the features.
    With slots = 1 this is the pair exchange of the paper's parallel SMO.
    """

    def __init__(self, n_features: int, rank: int = 0, world_size: int = 1, slots: int = 1, mode: str = "auto"
                 ) -> None:
        self.n_features = n_features
        self.rank = rank
        self.world_size = world_size
        self.slots = slots
        self.row = FIELDS + n_features
        width = 2 * slots * self.row
        self._send = torch.zeros(width, dtype=torch.float64)
        self._recv = torch.zeros(world_size * width, dtype=torch.float64)
        self.send = self._send.numpy().reshape(2 * slots, self.row)  # shares memory with the tensor
        self.table = self._recv.numpy().reshape(world_size, 2 * slots, self.row)
        self.seconds = 0.0
        self.calls = 0
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.shm: ShmAllGather | None = setup_allgather(width, mode) if self.distributed else None
        self.mode = "shm" if self.shm is not None else "gloo" if self.distributed else "local"

    def gather(self) -> np.ndarray:
        """The (W, 2 slots, row) table of every rank's candidates, the same on every rank."""
        self.calls += 1
        if not self.distributed:
            self.table[0] = self.send
            return self.table
        started = time.perf_counter()
        if self.shm is not None:
            self.shm.gather(self.send, self.table)
        else:
            dist.all_gather_single(self._recv, self._send)
        self.seconds += time.perf_counter() - started
        return self.table

    def close(self) -> None:
        """Unmap the shared-memory segment, if any (the per-iteration gather is not used afterwards)."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def reduce(self, values: np.ndarray, op: str) -> np.ndarray:
        """An all-reduce ('sum', 'min' or 'max') of a small float64 vector, timed like the exchange."""
        if not self.distributed:
            return values
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64).copy())
        started = time.perf_counter()
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                                    "max": dist.ReduceOp.MAX}[op])
        self.seconds += time.perf_counter() - started
        return tensor.numpy()

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's object in rank order (used once per solve, for the model and checkpoints)."""
        if not self.distributed:
            return [obj]
        started = time.perf_counter()
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        self.seconds += time.perf_counter() - started
        return out
