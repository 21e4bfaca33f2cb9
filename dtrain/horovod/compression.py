"""`hvd.Compression`: how DistributedOptimizer (and `allreduce(compression=...)`) puts gradients on the wire.

`none` and `fp16` behave as Horovod's (fp16 casts floating tensors to float16 and back; integers are left as
they are); `bf16` is the same with bfloat16, which Horovod never had. `Compression.dtrain(name, **options)`
offers dtrain's own compressors (`topk`, `qsgd`, `powersgd`, `sign`, `bounded_loss`, ...) to
DistributedOptimizer, which runs their rounds of communication on each fused gradient buffer.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Horovod's interface: `compress(tensor) -> (tensor, ctx)` and `decompress(tensor, ctx) -> tensor`."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """Sends tensors as they are."""


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 (half the bytes), are summed in float16 and cast back."""

    wire_dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class BF16Compressor(FP16Compressor):
    """As fp16, with bfloat16: the range of float32 at half the bytes."""

    wire_dtype = torch.bfloat16


class DtrainCompressor(Compressor):
    """One of dtrain's compressors (`dtrain.compress`), for DistributedOptimizer's fused gradient buffers."""

    def __init__(self, name: str, **options: Any) -> None:
        from dtrain.compress import build_compressor

        self.name = name
        self.compressor = build_compressor(name, **options)

    # Horovod declares compress static; dtrain's compressor keeps state per instance
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        raise ValueError(f"dtrain's {self.name} compressor works on DistributedOptimizer's gradient buffers; pass "
                         "it as DistributedOptimizer(..., compression=hvd.Compression.dtrain(...)), not to "
                         "allreduce()")


class Compression:
    """The compressors a script can name: `Compression.none`, `Compression.fp16`, `Compression.bf16`, and
    `Compression.dtrain(name, **options)`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def dtrain(name: str, **options: Any) -> DtrainCompressor:
        return DtrainCompressor(name, **options)
