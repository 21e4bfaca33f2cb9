"""`hvd.SyncBatchNorm`: batch normalization whose statistics are those of the global batch, on CPU too
(Horovod's needs a GPU). The per-rank sums travel through torch.distributed.nn's differentiable all-reduce, so
the backward pass is the exact gradient of the global statistics."""

from __future__ import annotations

import torch
from torch.distributed.nn.functional import all_reduce
from torch.nn.modules.batchnorm import _BatchNorm

from dtrain.horovod import basics


class SyncBatchNorm(_BatchNorm):
    """Drop-in for `torch.nn.BatchNorm{1,2,3}d` that normalizes with the mean and variance over every rank."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or basics.size() == 1:
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        count = torch.tensor([input.numel() / input.shape[1]], dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = all_reduce(stats)
        channels = input.shape[1]
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                momentum = self.momentum if self.momentum is not None else 0.1
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(var.detach() * (n / max(float(n) - 1, 1.0)) * momentum)
                if self.num_batches_tracked is not None:
                    self.num_batches_tracked.add_(1)
        shape = [1, channels] + [1] * (input.dim() - 2)
        normalized = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            normalized = normalized * self.weight.view(shape) + self.bias.view(shape)
        return normalized


__all__ = ["SyncBatchNorm"]
