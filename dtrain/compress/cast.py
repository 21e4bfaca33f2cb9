"""`none`, `fp16` and `bf16`: the bucket as it is, or cast to 16 bits for the wire (as torch's
`fp16_compress_hook` / `bf16_compress_hook`): divided by the divisor first so the sum cannot overflow, summed
by the all-reduce in 16 bits, and cast back into the fp32 gradient the optimizer uses."""

from __future__ import annotations

from typing import Any

import torch

from dtrain.compress.base import BucketInfo, Compressor, Decoded, Round


class NoCompression(Compressor):
    """Sends the bucket itself, divided in place by the divisor and then all-reduced, as DDP's reducer does
    with gradients that are views of their bucket."""

    name = "none"

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        return Round("all_reduce", [tensor.div_(bucket.divisor) if bucket.divisor != 1 else tensor])

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        return Decoded.done(received[0])


class CastCompression(Compressor):
    """Casts the (divided) bucket to a 16-bit float type for the wire: 2 bytes per element."""

    def __init__(self, wire_dtype: torch.dtype, name: str) -> None:
        super().__init__()
        self.wire_dtype = wire_dtype
        self.name = name

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        scaled = tensor / bucket.divisor if bucket.divisor != 1 else tensor
        return Round("all_reduce", [scaled.to(self.wire_dtype)], tensor.dtype)

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        return Decoded.done(received[0].to(ctx))


def fp16() -> CastCompression:
    return CastCompression(torch.float16, "fp16")


def bf16() -> CastCompression:
    return CastCompression(torch.bfloat16, "bf16")
