"""Failure classification on constructed exceptions: torch's types decide before any message, and the plain
RuntimeError texts are the ones torch 2.13's gloo raised (tests/distributed/test_failures.py makes them happen)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dtrain.comm.failures import Failure, classify_failure, is_unfinished_reduction

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "2000ms for recv operation to complete")
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    "[127.0.0.1]:36743. This is typically caused by a remote worker crashing. Check the logs of the "
                    "remote worker before reporting an error.")
DDP_UNUSED = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
              "indicates that your module has parameters that were not used in producing loss.")


@pytest.mark.parametrize(("exc", "expected"), [
    (RuntimeError(GLOO_TIMEOUT), Failure.TIMEOUT),
    (RuntimeError("Application timeout caused pair closure"), Failure.TIMEOUT),
    (RuntimeError(GLOO_PEER_CLOSED), Failure.LOST_PEER),
    (RuntimeError("[pair.cc:598] Read error [127.0.0.1]:2: Connection reset by peer"), Failure.LOST_PEER),
    (RuntimeError("Broken pipe"), Failure.LOST_PEER),
    (RuntimeError("Connection refused"), Failure.LOST_PEER),
    (RuntimeError(DDP_UNUSED), Failure.OTHER),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)"), Failure.OTHER),
    (ValueError("Timed out"), Failure.OTHER),  # not an error torch.distributed raises for a collective
])
def test_plain_runtime_errors_are_classified_by_their_message(exc: BaseException, expected: Failure) -> None:
    assert classify_failure(exc) is expected


@pytest.mark.parametrize(("exc", "expected"), [
    # the type decides, whatever the message says
    (dist.DistStoreError("wait timeout after 1000ms, keys: /default_pg/0//never-set"), Failure.TIMEOUT),
    (dist.DistStoreError("Timed out after 3 seconds waiting for clients. 1/2 clients joined."), Failure.TIMEOUT),
    (dist.DistStoreError("Connection closed by peer"), Failure.TIMEOUT),
    (dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."), Failure.LOST_PEER),
    (dist.DistNetworkError("Broken pipe"), Failure.LOST_PEER),
    (dist.DistNetworkError("Timed out"), Failure.LOST_PEER),
    (dist.DistError("Timed out"), Failure.OTHER),  # the base type alone says nothing more
    (dist.QueueEmptyError("queue_pop: empty queue"), Failure.TIMEOUT),  # a DistStoreError: a pop that waited out
])
def test_typed_errors_are_classified_by_their_type(exc: BaseException, expected: Failure) -> None:
    assert classify_failure(exc) is expected


@pytest.mark.parametrize(("message", "expected"), [
    ("[Rank 1] Work WorkNCCL(SeqNum=7, OpType=ALLREDUCE) timed out in blocking wait", Failure.TIMEOUT),
    ("NCCL communicator was aborted on rank 0: Connection reset by peer", Failure.LOST_PEER),
    ("NCCL error: invalid usage", Failure.OTHER),
])
def test_backend_errors_are_classified_by_their_message(message: str, expected: Failure) -> None:
    """DistBackendError covers timeouts, aborted communicators and usage errors alike."""
    assert classify_failure(dist.DistBackendError(message)) is expected


def test_typed_errors_are_runtime_errors() -> None:
    """The callers catch RuntimeError; every typed distributed error must still be one."""
    for kind in (dist.DistError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError):
        assert issubclass(kind, RuntimeError), kind


def test_unfinished_reduction_is_recognised_by_ddps_text() -> None:
    assert is_unfinished_reduction(RuntimeError(DDP_UNUSED + " Parameter indices which did not receive grad for "
                                                "rank 0: 2 3"))
    assert not is_unfinished_reduction(RuntimeError(GLOO_TIMEOUT))
    assert not is_unfinished_reduction(ValueError(DDP_UNUSED))
