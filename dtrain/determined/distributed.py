"""Determined's `DistributedContext`: the rank, size and local/cross ranks of this process, and object
collectives (`allgather`, `gather`, `broadcast` and their `_local` forms) over torch.distributed's default group
(Determined sends pickled objects between its own processes; here they go through gloo's object collectives)."""

from __future__ import annotations

import os
from typing import Any


class DistributedContext:
    """One process's place in the job and the object collectives between the processes."""

    def __init__(self, *, rank: int, size: int, local_rank: int, local_size: int, cross_rank: int,
                 cross_size: int, chief_ip: str | None = None) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.cross_rank, self.cross_size = cross_rank, cross_size
        self.chief_ip = chief_ip

    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> DistributedContext:
        """From the launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK); the default
        process group is created (gloo on loopback, as dtrain's workers do) unless the script already made it."""
        import torch.distributed as dist

        size = int(os.environ.get("WORLD_SIZE", "1"))
        owns = size > 1 and not dist.is_initialized()
        if owns:
            from dtrain.comm import init_distributed

            init_distributed()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
        context = cls(rank=int(os.environ.get("RANK", "0")), size=size,
                      local_rank=int(os.environ.get("LOCAL_RANK", "0")), local_size=local_size,
                      cross_rank=int(os.environ.get("GROUP_RANK", "0")), cross_size=max(size // max(local_size, 1), 1),
                      chief_ip=chief_ip or os.environ.get("MASTER_ADDR"))
        context._owns_group = owns
        return context

    _owns_group = False

    def close(self) -> None:
        """Leave the process group this context created (every rank together), so that no rank's exit tears down
        a store or a connection another rank still uses."""
        if not self._owns_group:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        self._owns_group = False

    @classmethod
    def single(cls) -> DistributedContext:
        """A job of one process (Determined's `DummyDistributedContext`)."""
        return cls(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)

    def get_rank(self) -> int:
        return self.rank

    def get_size(self) -> int:
        return self.size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_size(self) -> int:
        return self.local_size

    def get_cross_rank(self) -> int:
        return self.cross_rank

    def get_cross_size(self) -> int:
        return self.cross_size

    @property
    def _distributed(self) -> bool:
        return self.size > 1

    def allgather(self, stuff: Any) -> list[Any]:
        """Every process's object, in rank order, on every process."""
        if not self._distributed:
            return [stuff]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, stuff)
        return out

    def gather(self, stuff: Any) -> list[Any] | None:
        """Every process's object, in rank order, on the chief; None elsewhere."""
        gathered = self.allgather(stuff)
        return gathered if self.rank == 0 else None

    def broadcast(self, stuff: Any) -> Any:
        """The chief's object on every process."""
        if not self._distributed:
            return stuff
        import torch.distributed as dist

        box = [stuff if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _local_group(self) -> list[int]:
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_size))

    def allgather_local(self, stuff: Any) -> list[Any]:
        """The objects of the processes on this machine, in local-rank order."""
        everyone = self.allgather(stuff)
        return [everyone[r] for r in self._local_group()]

    def gather_local(self, stuff: Any) -> list[Any] | None:
        local = self.allgather_local(stuff)
        return local if self.local_rank == 0 else None

    def broadcast_local(self, stuff: Any = None) -> Any:
        """The local chief's object on every process of this machine."""
        return self.allgather_local(stuff)[0]
