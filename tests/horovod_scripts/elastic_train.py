"""An elastic trainer in the style of Horovod's elastic docs: TorchState holding the model, the optimizer, an
ElasticSampler and the epoch/batch counters; `@hvd.elastic.run` around the training loop; `state.commit()`
every few batches. Under `--reset-limit` (torchrun's restarts) a worker that dies takes the job down, the launcher
restarts it, and training resumes from the last commit instead of from the start; under `--min-np/--max-np` the
survivors go on without it (see elastic_resize.py).

    dtrain horovodrun -np 2 --reset-limit 3 python tests/horovod_scripts/elastic_train.py
"""

import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="PyTorch elastic example")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--batches-per-commit", type=int, default=2)
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds per batch (to leave room for a kill)")
parser.add_argument("--progress", help="append one JSON line per batch here (rank 0)")
parser.add_argument("--results", help="write the final state here as JSON (rank 0)")
parser.add_argument("--save-model", help="save the final model's state_dict here (rank 0)")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
features = torch.randn(args.samples, 10)
labels = (features.sum(1) > 0).long()
dataset = torch.utils.data.TensorDataset(features, labels)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size()),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


@hvd.elastic.run
def train(state):
    starts = 0
    while state.epoch < args.epochs:
        starts += 1
        for batch_idx, (data, target) in enumerate(loader, start=state.batch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, args.batch_size)
            state.batch = batch_idx + 1
            state.trained += 1
            if args.sleep:
                time.sleep(args.sleep)
            if hvd.rank() == 0 and args.progress:
                with open(args.progress, "a") as handle:
                    handle.write(json.dumps({"epoch": state.epoch, "batch": state.batch, "pid": os.getpid()}) + "\n")
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        state.commit()
    return loss.item()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, trained=0)
final_loss = train(state)
if hvd.rank() == 0:
    print(f"done: {state.epoch} epochs, {state.trained} batches trained since the last restart's commit, "
          f"loss {final_loss:.4f}", flush=True)
    if args.save_model:
        torch.save(model.state_dict(), args.save_model)
    if args.results:
        with open(args.results, "w") as handle:
            json.dump({"epochs": state.epoch, "trained": state.trained, "loss": final_loss}, handle)
