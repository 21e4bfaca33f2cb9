"""Sign compression with a scale and error feedback (EF-SignSGD, Karimireddy et al., ICML 2019,
arXiv:1901.09847; 1-bit SGD, Seide et al. 2014).

Each step a = g + e; every gradient tensor of the bucket is sent as one bit per element (its sign, packed
eight to a byte) and one scale (fp32 in training), mean|a| over the tensor, so that the sent tensor
scale * sign(a) has the same l1 norm as a; e = a - scale * sign(a). Scales differ per rank, so the payloads
are all-gathered and every rank decodes and sums them: ceil(n/8) + 4 * tensors bytes per rank.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.compress.base import BucketInfo, Compressor, ErrorFeedback, Round

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element (1 for >= 0), eight to a byte, the first element in the highest bit."""
    bits = (values >= 0).to(torch.uint8)
    padded = torch.zeros((values.numel() + 7) // 8 * 8, dtype=torch.uint8)
    padded[: values.numel()] = bits
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """+1.0 / -1.0 per element, inverse of `pack_signs`."""
    bits = (packed.unsqueeze(1) & _BIT_WEIGHTS).ne(0).view(-1)[:numel]
    return bits.to(torch.float32).mul_(2).sub_(1)


def segment_ids(bucket: BucketInfo, numel: int) -> torch.Tensor:
    """For each element of the flat bucket, the index of the gradient tensor it belongs to."""
    lengths = [int(shape.numel()) for _, shape in sorted(bucket.spans, key=lambda span: span[0])] or [numel]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


class SignCompression(Compressor):
    name = "sign"

    def __init__(self, error_feedback: bool = True) -> None:
        super().__init__()
        self.feedback = ErrorFeedback() if error_feedback else None
        self._segments: dict[int, torch.Tensor] = {}

    def _segments_of(self, bucket: BucketInfo, numel: int) -> torch.Tensor:
        ids = self._segments.get(bucket.key)
        if ids is None or ids.numel() != numel:
            ids = self._segments[bucket.key] = segment_ids(bucket, numel)
        return ids

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        flat = tensor.reshape(-1)
        accumulated = self.feedback.add_residual(bucket.key, flat) if self.feedback else flat
        ids = self._segments_of(bucket, flat.numel())
        count = int(ids[-1]) + 1
        sums = torch.zeros(count, dtype=flat.dtype).index_add_(0, ids, accumulated.abs())
        scales = sums / torch.bincount(ids, minlength=count).to(flat.dtype)
        packed = pack_signs(accumulated)
        if self.feedback:
            sent = self._decode(packed, scales, ids)
            self.feedback.keep(bucket.key, accumulated, sent)
        return Round("all_gather", [scales, packed], (ids, tensor.dtype, bucket.divisor))

    @staticmethod
    def _decode(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return unpack_signs(packed, ids.numel()).to(scales.dtype).mul_(scales[ids])

    def decompress(self, received: Any, ctx: Any) -> torch.Tensor:
        ids, dtype, divisor = ctx
        total = torch.zeros(ids.numel(), dtype=dtype)
        for scales, packed in received:
            total.add_(self._decode(packed, scales, ids))
        return total / divisor if divisor != 1 else total

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "error_feedback": self.feedback is not None}
