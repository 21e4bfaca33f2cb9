"""A trial in Determined's Core API style: the script owns its loop and its distribution (DDP over the process group
the DistributedContext sets up), reports metrics, stores checkpoints, resumes from the latest one, follows the
searcher's length and stops when asked to.

`--kill-at N` SIGKILLs the process at batch N on its first attempt (a crash for the resume test)."""

from __future__ import annotations

import argparse
import os
import signal

import determined as det
import torch
import torch.nn.functional as F
from data import network, regression


def main(core: det.core.Context, kill_at: int | None, report_every: int) -> None:
    info = det.get_cluster_info()
    assert info is not None, "run this under `dtrain run core.yaml`"
    hparams = info.trial.hparams
    rank, size = core.distributed.get_rank(), core.distributed.get_size()
    torch.manual_seed(0)
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=hparams["learning_rate"], momentum=0.9)
    trained = model
    if size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    data, validation = regression(256, seed=1), regression(64, seed=2)
    batch_size = hparams["global_batch_size"]
    per_rank = batch_size // size
    start = 0
    if info.latest_checkpoint is not None:
        with core.checkpoint.restore_path(info.latest_checkpoint) as path:
            state = torch.load(path / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["batches"]
        print(f"resumed from checkpoint {info.latest_checkpoint} at batch {start}", flush=True)
    for op in core.searcher.operations():
        for batch in range(start, op.length):
            if kill_at is not None and batch + 1 == kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            first = (batch * batch_size) % len(data) + rank * per_rank
            inputs, targets = data[first:first + per_rank]
            loss = F.mse_loss(trained(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done = batch + 1
            if done % report_every == 0 or done == op.length:
                with torch.no_grad():
                    val = F.mse_loss(model(validation.tensors[0]), validation.tensors[1]).item()
                core.train.report_training_metrics(steps_completed=done, metrics={"loss": loss.item()})
                core.train.report_validation_metrics(steps_completed=done, metrics={"validation_loss": val})
                if rank == 0:
                    with core.checkpoint.store_path({"steps_completed": done}) as (path, _):
                        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "batches": done}, path / "state.pt")
                op.report_progress(done)
                if core.preempt.should_preempt():
                    return
        op.report_completed(val)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--report-every", type=int, default=4)
    args = parser.parse_args()
    distributed = det.core.DistributedContext.from_torch_distributed()
    with det.core.init(distributed=distributed) as core_context:
        main(core_context, args.kill_at, args.report_every)
