"""What a failed collective or store operation means: it timed out, a peer process is gone, or something else.

torch's typed exceptions decide first. Where torch 2.13 raises a plain RuntimeError, and for its one broad type
(DistBackendError, which NCCL raises for timeouts, aborted communicators and usage errors alike), the message
decides. Observed in 2-process gloo runs on torch 2.13.0 (tests/distributed/test_failures.py repeats them):

- a collective that times out: RuntimeError "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
  1000ms for recv operation to complete" (all_reduce, barrier, broadcast_object_list; async work's wait() too);
- a collective whose peer died or left: RuntimeError "[.../gloo/transport/tcp/pair.cc:553] Connection closed by
  peer [127.0.0.1]:port. This is typically caused by a remote worker crashing ...", or, depending on how the
  socket learns it, "[.../pair.cc:537] Read error [127.0.0.1]:port: Connection reset by peer ...";
- a store get/wait that times out: DistStoreError "wait timeout after 1000ms, keys: ..."; a rendezvous that
  times out: DistStoreError "Timed out after 3 seconds waiting for clients. 1/2 clients joined.";
- a store whose server died: DistNetworkError "Failed to recv, got 0 bytes. Connection was likely closed. ..."
  or "Broken pipe".

DDP's error for parameters without a gradient is a plain RuntimeError too ("Expected to have finished reduction
in the prior iteration ..."): `is_unfinished_reduction` recognises it by that text, since no type exists.
"""

from __future__ import annotations

import enum

import torch.distributed as dist


class Failure(enum.Enum):
    """What went wrong in a collective or store operation."""

    TIMEOUT = "timeout"  # the operation waited longer than the group's or store's timeout
    LOST_PEER = "lost peer"  # another process (a worker, or the store's host) is gone
    OTHER = "other"


# Plain RuntimeError texts (gloo, and torch's RPC agent) and DistBackendError texts (NCCL), per kind.
TIMEOUT_MARKERS = ("Timed out", "timed out", "Application timeout")
LOST_PEER_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
UNFINISHED_REDUCTION_MARKER = "Expected to have finished reduction"


def classify_failure(exc: BaseException) -> Failure:
    """The kind of failure `exc` reports: torch's exception type where it says, else the message's words."""
    if isinstance(exc, dist.DistNetworkError):  # the TCP connection to a peer or the store broke
        return Failure.LOST_PEER
    if isinstance(exc, dist.DistStoreError):  # the store's own errors are its timeouts (get, wait, rendezvous)
        return Failure.TIMEOUT
    if isinstance(exc, dist.DistError) and not isinstance(exc, dist.DistBackendError):
        return Failure.OTHER
    if not isinstance(exc, RuntimeError):  # DistBackendError is a RuntimeError too
        return Failure.OTHER
    text = str(exc)
    if any(marker in text for marker in TIMEOUT_MARKERS):
        return Failure.TIMEOUT
    if any(marker in text for marker in LOST_PEER_MARKERS):
        return Failure.LOST_PEER
    return Failure.OTHER


def is_unfinished_reduction(exc: BaseException) -> bool:
    """True for DDP's error about a reduction that did not finish (parameters that got no gradient)."""
    return isinstance(exc, RuntimeError) and UNFINISHED_REDUCTION_MARKER in str(exc)
