"""A Horovod Elastic job that changes size while it trains: a logistic-regression-sized classifier on random data,
its model, optimizer, sampler and counters in a `TorchState` committed every few batches, the learning rate
rescaled to `hvd.size()` by a reset callback. `--lose-rank R --lose-at-batch N` makes rank R kill itself (SIGKILL)
after its N-th batch while the job has `--lose-at-size` processes: the others roll back to the last commit, re-form
without it and finish at the smaller size. With a host discovery script that reports more slots, the job grows at
a commit instead.

    dtrain horovodrun -np 3 --min-np 2 --max-np 3 python tests/horovod_scripts/elastic_resize.py \
        --lose-rank 2 --lose-at-batch 7
"""

import argparse
import json
import os
import signal
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="an elastic job that loses or gains processes")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=576)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--commit-every", type=int, default=3, help="batches between state.commit() calls")
parser.add_argument("--base-lr", type=float, default=0.02, help="learning rate per process")
parser.add_argument("--lose-rank", type=int, default=-1, help="this rank kills itself ...")
parser.add_argument("--lose-at-batch", type=int, default=-1, help="... after this many batches ...")
parser.add_argument("--lose-at-size", type=int, default=3, help="... while the job has this many processes")
parser.add_argument("--pause", type=float, default=0.0, help="seconds of sleep per batch")
parser.add_argument("--log", help="rank 0 appends one JSON line per batch here")
parser.add_argument("--summary", help="rank 0 writes what it saw here at the end")
parser.add_argument("--save-model", help="rank 0 saves the final model's state_dict here")
opts = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
points = torch.randn(opts.samples, 6)
classes = (points[:, :3].sum(1) > points[:, 3:].sum(1)).long()
data = torch.utils.data.TensorDataset(points, classes)
net = torch.nn.Linear(6, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=opts.base_lr * hvd.size(), momentum=0.5),
                               named_parameters=net.named_parameters())
sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=7)
batches = torch.utils.data.DataLoader(data, batch_size=opts.batch_size, sampler=sampler)
sizes_after_reset = []


def rescale_lr():
    sizes_after_reset.append(hvd.size())
    for group in opt.param_groups:
        group["lr"] = opts.base_lr * hvd.size()


def note(entry):
    if hvd.rank() == 0 and opts.log:
        with open(opts.log, "a") as out:
            out.write(json.dumps(entry) + "\n")


@hvd.elastic.run
def fit(job):
    while job.epoch < opts.epochs:
        for data_batch, label_batch in batches:
            opt.zero_grad()
            loss = F.cross_entropy(net(data_batch), label_batch)
            loss.backward()
            opt.step()
            job.sampler.record_batch(job.batch, opts.batch_size)
            job.batch += 1
            job.seen += len(data_batch) * hvd.size()
            note({"epoch": job.epoch, "batch": job.batch, "size": hvd.size(), "pid": os.getpid(),
                  "lr": opt.param_groups[0]["lr"]})
            if opts.pause:
                time.sleep(opts.pause)
            if hvd.size() == opts.lose_at_size and hvd.rank() == opts.lose_rank and job.batch == opts.lose_at_batch:
                os.kill(os.getpid(), signal.SIGKILL)
            if job.batch % opts.commit_every == 0:
                job.commit()
        job.epoch += 1
        job.batch = 0
        job.sampler.set_epoch(job.epoch)
        job.commit()
    return loss.item()


job = hvd.elastic.TorchState(net, opt, sampler=sampler, epoch=0, batch=0, seen=0)
job.register_reset_callbacks([rescale_lr])
last_loss = fit(job)
if hvd.rank() == 0 and opts.save_model:
    torch.save(net.state_dict(), opts.save_model)
if hvd.rank() == 0 and opts.summary:
    with open(opts.summary, "w") as out:
        json.dump({"size": hvd.size(), "sizes_after_reset": sizes_after_reset, "epochs": job.epoch,
                   "seen": job.seen, "loss": last_loss, "lr": opt.param_groups[0]["lr"]}, out)
