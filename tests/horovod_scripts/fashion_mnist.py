"""A Fashion-MNIST trainer written the way Horovod's documentation teaches: hvd.init, a DistributedSampler per
rank, the learning rate scaled by hvd.size(), broadcast of parameters and optimizer state from rank 0,
DistributedOptimizer, metrics averaged with hvd.allreduce, and optionally AMP with synchronize/skip_synchronize.

    dtrain horovodrun -np 2 python tests/horovod_scripts/fashion_mnist.py --epochs 3
"""

import argparse
import gzip
import json
import os

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data.distributed

parser = argparse.ArgumentParser(description="PyTorch Fashion-MNIST example with Horovod")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size per worker for training")
parser.add_argument("--test-batch-size", type=int, default=1000, help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate (per worker; scaled by hvd.size())")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=100, help="batches between progress lines")
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", help="use Adasum instead of averaging")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0, help="pre-divide before the sum")
parser.add_argument("--use-amp", action="store_true", help="mixed precision (bfloat16 autocast on CPU)")
parser.add_argument("--data-dir", default=os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
parser.add_argument("--train-samples", type=int, default=0, help="use only the first N training samples (0: all)")
parser.add_argument("--results", help="write the final test metrics here as JSON (rank 0)")
parser.add_argument("--save-model", help="save the final model's state_dict here (rank 0)")


def read_idx(path):
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def dataset(folder, kind, limit=0):
    images = read_idx(os.path.join(folder, f"{kind}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(folder, f"{kind}-labels-idx1-ubyte.gz"))
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - 0.2860) / 0.3530
    return torch.utils.data.TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = dataset(args.data_dir, "train", args.train_samples)
    test_dataset = dataset(args.data_dir, "t10k")
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16 needs no loss scaling; the pattern is the same

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            if args.use_amp:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(data), target)
                scaler.scale(loss).backward()
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            else:
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}",
                      flush=True)

    model.eval()
    test_loss, test_correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            test_correct += output.argmax(1).eq(target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    test_accuracy = metric_average(test_correct / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        if args.save_model:
            torch.save(model.state_dict(), args.save_model)
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)
        if args.results:
            with open(args.results, "w") as handle:
                json.dump({"accuracy": test_accuracy, "loss": test_loss, "size": hvd.size()}, handle)


if __name__ == "__main__":
    main()
