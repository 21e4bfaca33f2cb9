"""Background checkpoint uploads (dtrain.train.upload, Checkpointer with background=True) on fsspec's in-memory
object store, which like S3 has no rename: the snapshot is what the step held, however training changes the model
meanwhile; `latest` and keep-latest deletion move only once the new checkpoint is committed; a new checkpoint
waits for the one in flight; an upload's error reaches the training thread as one line."""

from __future__ import annotations

import io
import threading
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.comm import Topology
from dtrain.errors import CheckpointError
from dtrain.runs.storage import CheckpointStore
from dtrain.train import checkpoint as ckpt
from dtrain.train.callbacks import StepCallback, StepCallbacks
from dtrain.train.checkpointing import Checkpointer, PlainCheckpointState
from dtrain.train.state import TrainerState
from dtrain.train.upload import UPLOAD_THREAD, BackgroundUploads, host_snapshot


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_a_snapshot_saves_the_same_bytes_and_no_longer_follows_the_original() -> None:
    model = nn.Linear(4, 3)
    base = torch.arange(6.0)
    state = {"model": model.state_dict(), "views": [base[:3], base[3:]], "history": [{"step": 1}]}
    before = _saved(state)
    snapshot = host_snapshot(state)
    assert _saved(snapshot) == before  # the same file as of the original (storage sharing and _metadata kept)
    with torch.no_grad():
        model.weight.add_(1.0)
    base.mul_(2.0)
    state["history"].append({"step": 2})
    assert _saved(snapshot) == before
    assert snapshot["views"][0].untyped_storage().data_ptr() == snapshot["views"][1].untyped_storage().data_ptr()


def test_one_upload_in_flight_the_next_waits_for_it() -> None:
    uploads, order, release = BackgroundUploads(), [], threading.Event()

    def first() -> str:
        order.append("first starts")
        release.wait()
        order.append("first ends")
        return "first"

    uploads.submit("step-1", first)
    threading.Timer(0.2, release.set).start()  # only lets the first one end; nothing asserts on a duration
    uploads.submit("step-2", lambda: order.append("second starts") or "second")
    uploads.wait()
    assert order == ["first starts", "first ends", "second starts"]
    assert uploads.take_committed() == ["first", "second"] and uploads.take_committed() == []


def test_an_upload_error_is_one_line_on_the_training_thread() -> None:
    uploads = BackgroundUploads()

    def broken() -> None:
        raise PermissionError("AccessDenied: no write")

    uploads.submit("s3://bucket/run/step-5", broken)
    with pytest.raises(CheckpointError) as raised:
        uploads.wait()
    text = str(raised.value)
    assert "step-5" in text and "access denied" in text and "\n" not in text
    assert uploads.take_committed() == []  # raised once


class _Gate(StepCallback):
    """Holds the upload of `step` between model.pt and the rest until released."""

    def __init__(self, step: int) -> None:
        self.step, self.reached, self.release, self.thread = step, threading.Event(), threading.Event(), ""

    def during_checkpoint(self, step: int) -> None:
        if step == self.step:
            self.thread = threading.current_thread().name
            self.reached.set()
            assert self.release.wait(timeout=120)


def _checkpointer(store: CheckpointStore, model: nn.Module, gate: _Gate) -> tuple[Checkpointer, dict[str, Any]]:
    topology = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, backend="gloo",
                        device=torch.device("cpu"), launcher="test")
    strategy = SimpleNamespace(unwrap_model=lambda: model, state_dict=lambda: {})
    policy = SimpleNamespace(keep_latest=1, best_steps=lambda metrics: set())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimization = SimpleNamespace(optimizer=optimizer, schedule_state=lambda: {})
    checkpointer = Checkpointer(store, topology, PlainCheckpointState(strategy), policy,  # type: ignore[arg-type]
                                StepCallbacks([gate]), background=True)
    return checkpointer, {"optimization": optimization, "strategy": strategy, "epoch": 0.0}


def test_background_checkpoint_commits_the_step_s_state_and_prunes_only_after_its_commit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(url=f"memory://dtrain-upload-{uuid.uuid4().hex[:8]}/run")
    model, gate = nn.Linear(3, 2), _Gate(step=2)
    checkpointer, parts = _checkpointer(store, model, gate)
    state = TrainerState()
    checkpointer.write(1, None, state=state, **parts)
    checkpointer.finish_uploads()
    assert [ref.step for ref in checkpointer.take_committed()] == [1]

    begin, write = threading.Event(), ckpt.write_checkpoint

    def held_write(*args: Any, **kwargs: Any) -> ckpt.CheckpointRef:
        assert begin.wait(timeout=120)
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", held_write)
    at_step_2 = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    checkpointer.write(2, None, state=state, **parts)  # returns before the upload has written anything
    with torch.no_grad():  # training goes on and changes the model in place
        for parameter in model.parameters():
            parameter.add_(1.0)
    begin.set()
    assert gate.reached.wait(timeout=120)  # in the middle of the upload: model.pt is up, meta.json is not
    assert gate.thread == UPLOAD_THREAD
    assert store.exists("step-2/model.pt") and not store.exists("step-2/meta.json")
    assert ckpt.read_latest_name(store) == "step-1" and store.exists("step-1/meta.json")  # nothing pruned yet
    assert ckpt.find_resume_checkpoint(store).step == 1  # a kill now resumes from step-1
    assert checkpointer.take_committed() == []
    gate.release.set()
    checkpointer.finish_uploads()
    [ref] = checkpointer.take_committed()
    assert ref.step == 2 and checkpointer.newest() == ref
    assert ckpt.read_latest_name(store) == "step-2" and ckpt.checkpoint_names(store) == ["step-2"]
    saved, _ = ckpt.load_checkpoint(ckpt.find_resume_checkpoint(store))
    assert all(torch.equal(saved[name], at_step_2[name]) for name in at_step_2)  # the step's weights, not later ones
