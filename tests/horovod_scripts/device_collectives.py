"""Horovod's collectives and DistributedOptimizer on one device, each checked against a reference computed on this
rank: allreduce (every op, fused and not, fp16/bf16 and int16 included), allgather, broadcast, alltoall,
reducescatter, and the optimizer's float64 weights against a plain full-batch loop. Every result must also stay on
the device it came from (CUDA tensors are never carried through the host). Rank 0 writes what it found as JSON.

    dtrain horovodrun -np 1 python tests/horovod_scripts/device_collectives.py --device cuda --results out.json

(The optimizer reduces at one rank only under HOROVOD_ELASTIC=1, as Horovod's does; the GPU check sets it.)
"""

import argparse
import json
import sys

import horovod.torch as hvd
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser(description="Horovod collectives on one device against local references")
parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the tensors live")
parser.add_argument("--results", help="write the checks here as JSON (rank 0)")
parser.add_argument("--steps", type=int, default=5, help="optimizer steps")


def rank_input(rank, dtype, shape, salt):
    """Rank `rank`'s input, the same wherever it is computed (so every rank can compute every rank's)."""
    generator = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 4).to(dtype)
    low, high = (0, 200) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def compare(got, expected, device, tolerance=0.0):
    """(passed, largest difference): same dtype, shape and device, values within `tolerance` (relative for
    floating types)."""
    if got.device != device or got.dtype != expected.dtype or got.shape != expected.shape:
        return False, f"got {got.dtype} {tuple(got.shape)} on {got.device}"
    difference = (got.detach().cpu().double() - expected.double()).abs()
    largest = float(difference.max()) if difference.numel() else 0.0
    bound = tolerance * (1.0 + expected.double().abs())
    return bool((difference <= bound).all()), largest


def main():
    args = parser.parse_args()
    hvd.init()
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    size, rank = hvd.size(), hvd.rank()
    checks = {}

    def record(name, got, expected, tolerance=0.0):
        passed, largest = compare(got, expected, device, tolerance)
        checks[name] = {"passed": passed, "max_abs_difference": largest}

    # reductions: the reference sums in float64 / int64 over every rank's input, then rounds to the type
    tolerances = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-12}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int16,
                  torch.int32, torch.int64):
        inputs = [rank_input(r, dtype, (3, 5), salt=1) for r in range(size)]
        wide = torch.stack([t.double() if dtype.is_floating_point else t.long() for t in inputs])
        mine = inputs[rank].to(device)
        tolerance = tolerances.get(dtype, 0.0)
        name = str(dtype).replace("torch.", "")
        record(f"allreduce sum {name}", hvd.allreduce(mine, op=hvd.Sum, name=f"sum.{name}"),
               wide.sum(0).to(dtype), tolerance)
        record(f"allreduce max {name}", hvd.allreduce(mine, op=hvd.Max, name=f"max.{name}"),
               wide.max(0).values.to(dtype), tolerance)
        if dtype.is_floating_point:
            record(f"allreduce average {name}", hvd.allreduce(mine, name=f"avg.{name}"),
                   (wide.sum(0) / size).to(dtype), tolerance)
            in_place = mine.clone()
            hvd.allreduce_(in_place, op=hvd.Min, name=f"min.{name}")
            record(f"allreduce_ min {name}", in_place, wide.min(0).values.to(dtype), tolerance)
    # several allreduces of one dtype ready together: fused into one buffer, which must stay on the device
    group = [rank_input(rank, torch.float32, (n,), salt=10 + n).to(device) for n in (7, 1, 64)]
    reduced = hvd.grouped_allreduce(group, op=hvd.Sum, name="fused")
    for n, got in zip((7, 1, 64), reduced, strict=True):
        expected = torch.stack([rank_input(r, torch.float32, (n,), salt=10 + n).double() for r in range(size)]).sum(0)
        record(f"grouped allreduce float32 [{n}]", got, expected.float(), 1e-6)
    # allgather: rank r gives r + 1 rows
    for dtype in (torch.float32, torch.int16, torch.bool):
        pieces = [rank_input(r, dtype, (r + 1, 4), salt=20) for r in range(size)]
        name = str(dtype).replace("torch.", "")
        record(f"allgather {name}", hvd.allgather(pieces[rank].to(device), name=f"gather.{name}"),
               torch.cat(pieces))
    # broadcast from the last rank
    root = size - 1
    for dtype in (torch.float64, torch.int16, torch.bool):
        name = str(dtype).replace("torch.", "")
        expected = rank_input(root, dtype, (6,), salt=30)
        record(f"broadcast {name}", hvd.broadcast(rank_input(rank, dtype, (6,), salt=30).to(device), root,
                                                  name=f"bcast.{name}"), expected)
    # alltoall: every rank sends rank r its row block r
    sent = [rank_input(r, torch.float32, (2 * size, 3), salt=40) for r in range(size)]
    record("alltoall float32", hvd.alltoall(sent[rank].to(device), name="a2a"),
           torch.cat([sent[r][2 * rank:2 * rank + 2] for r in range(size)]))
    # reducescatter: this rank's rows of the sum
    rows = [rank_input(r, torch.float64, (2 * size, 3), salt=50) for r in range(size)]
    record("reducescatter float64", hvd.reducescatter(rows[rank].to(device), op=hvd.Sum, name="rs"),
           torch.stack(rows).sum(0)[2 * rank:2 * rank + 2], 1e-12)

    # DistributedOptimizer against a plain loop over the global batch (float64, SGD with momentum)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    plain.load_state_dict(model.state_dict())
    model.to(device)
    plain.to(device)
    generator = torch.Generator().manual_seed(6)
    inputs = torch.randn(4 * size, 8, generator=generator, dtype=torch.float64).to(device)
    targets = torch.randn(4 * size, 1, generator=generator, dtype=torch.float64).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    mine = slice(4 * rank, 4 * rank + 4)
    for _ in range(args.steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine]).backward()
        optimizer.step()
        reference.zero_grad()
        torch.nn.functional.mse_loss(plain(inputs), targets).backward()
        reference.step()
    for (name, got), expected in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        record(f"DistributedOptimizer {name}", got, expected.cpu(), 1e-9)

    if rank == 0 and args.results:
        with open(args.results, "w") as out:
            json.dump({"size": size, "device": str(device), "backend": dist.get_backend_config(), "checks": checks},
                      out, indent=2)
    hvd.shutdown()
    return 0 if all(check["passed"] for check in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
