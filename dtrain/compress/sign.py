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

from dtrain.compress.base import BucketInfo, Compressor, Decoded, Round

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element (1 for >= 0), eight to a byte, the first element in the highest bit."""
    bits = (values >= 0).to(torch.uint8)
    padded = torch.zeros((values.numel() + 7) // 8 * 8, dtype=torch.uint8)
    padded[: values.numel()] = bits
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


# row b: the eight signs (+1 / -1) byte b stands for, the highest bit first
_SIGNS_OF_BYTE = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) & _BIT_WEIGHTS).ne(0).to(torch.float64) * 2 - 1)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """+1 / -1 per element, inverse of `pack_signs` (one table lookup per byte)."""
    return _SIGNS_OF_BYTE.to(dtype)[packed.long()].view(-1)[:numel]


def segments(bucket: BucketInfo, numel: int) -> list[tuple[int, int]]:
    """(offset, length) of each gradient tensor in the flat bucket, in buffer order."""
    spans = sorted((offset, int(shape.numel())) for offset, shape in bucket.spans)
    return spans or [(0, numel)]


class SignCompression(Compressor):
    name = "sign"

    def __init__(self, error_feedback: bool = True) -> None:
        super().__init__()
        self.error_feedback = error_feedback

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        flat = tensor.reshape(-1)
        accumulated = self.state.add_residual(bucket.key, flat) if self.error_feedback else flat
        spans = segments(bucket, flat.numel())
        scales = torch.stack([accumulated[o : o + n].abs().mean() for o, n in spans])
        packed = pack_signs(accumulated)
        if self.error_feedback:  # residual = accumulated - sent, computed in place
            accumulated.sub_(self._decode(packed, scales, spans, flat.numel()))
            self.state.residuals[bucket.key] = accumulated
        return Round("all_gather", [scales, packed], (flat, spans, bucket.divisor))

    @staticmethod
    def _decode(packed: torch.Tensor, scales: torch.Tensor, spans: list[tuple[int, int]], numel: int) -> torch.Tensor:
        signs = unpack_signs(packed, numel, scales.dtype)
        for (offset, length), scale in zip(spans, scales, strict=True):
            signs[offset : offset + length].mul_(scale)
        return signs

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        """The sum of every rank's signs times its scales, written into the bucket itself."""
        out, spans, divisor = ctx
        for rank, (scales, packed) in enumerate(received):
            decoded = self._decode(packed, scales / divisor if divisor != 1 else scales, spans, out.numel())
            out.copy_(decoded) if rank == 0 else out.add_(decoded)
        return Decoded.done(out)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "error_feedback": self.error_feedback}
