"""Synthetic-data throughput in the style of Horovod's PyTorch benchmark: a model on random images, timed in
iterations of a few batches after a warm-up, printing "Img/sec per GPU" as Horovod's does.

    dtrain horovodrun -np 2 python tests/horovod_scripts/synthetic_benchmark.py --num-iters 10
"""

import argparse
import json
import timeit

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression")
parser.add_argument("--model", default="convnet", help="convnet, or a torchvision model name if installed")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=64, help="height and width of the random images")
parser.add_argument("--num-warmup-batches", type=int, default=5, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm")
parser.add_argument("--results", help="write img/sec per worker (mean and every iteration) here as JSON (rank 0)")
parser.add_argument("--seed", type=int, default=42, help="random seed (model and data)")
parser.add_argument("--save-model", help="save the final model's state_dict here (rank 0)")


def convnet():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(128 * 16, 256), nn.ReLU(), nn.Linear(256, 1000))


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.model == "convnet":
        model = convnet()
    else:
        from torchvision import models
        model = getattr(models, args.model)()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.LongTensor(args.batch_size).random_() % 1000

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of GPUs: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per GPU")
        img_secs.append(img_sec)
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per GPU: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} GPU(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    if args.save_model and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save_model)
    if args.results and hvd.rank() == 0:
        with open(args.results, "w") as handle:
            json.dump({"img_sec_per_worker": float(img_sec_mean), "iterations": img_secs, "size": hvd.size()}, handle)


if __name__ == "__main__":
    main()
