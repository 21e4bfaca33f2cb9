"""QSGD (Alistarh et al., NeurIPS 2017, arXiv:1610.02132): stochastic quantization to s levels, unbiased.

The bucket is cut into chunks of `chunk_size` elements (the paper's bucketing, d = 512 in its experiments);
each chunk v is sent as its norm (in the gradient's dtype, fp32 in training) and, per element, sgn(v_i) * l_i
with l_i in 0..s: l_i is floor(s|v_i|/norm) rounded up with probability equal to the remainder, so
E[norm * sgn(v_i) * l_i / s] = v_i.
With s <= 127 sign and level fit one signed byte: at most 8 bits per element on the wire. Each rank has its
own norms, so the payloads cannot be summed: they are all-gathered and every rank decodes and sums them.
`norm: l2` is the paper's; `norm: max` (the common variant) uses max|v_i|, with lower variance.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from dtrain.compress.base import BucketInfo, Compressor, Decoded, Round


class QSGD(Compressor):
    name = "qsgd"

    def __init__(self, levels: int = 127, chunk_size: int = 512, norm: Literal["l2", "max"] = "l2",
                 error_feedback: bool = False, seed: int = 0) -> None:
        super().__init__()
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels {levels} must be in 1..127 (sign and level in one byte)")
        self.levels = levels
        self.chunk_size = chunk_size
        self.norm = norm
        self.error_feedback = error_feedback
        self.seed = seed
        self._generator: torch.Generator | None = None

    def _rng(self, rank: int) -> torch.Generator:
        if self._generator is None:  # each rank rounds with its own reproducible stream
            self._generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rank)
        return self._generator

    def quantize(self, tensor: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels as int8 of the padded chunks, one fp32 norm per chunk)."""
        chunks = math.ceil(tensor.numel() / self.chunk_size)
        flat = tensor.reshape(-1)
        if flat.numel() == chunks * self.chunk_size:
            rows = flat.view(chunks, self.chunk_size)
        else:
            rows = torch.zeros(chunks, self.chunk_size, dtype=tensor.dtype)
            rows.view(-1)[: flat.numel()] = flat
        magnitude = rows.abs()
        norms = rows.norm(dim=1) if self.norm == "l2" else magnitude.amax(dim=1)
        magnitude.mul_((self.levels / torch.where(norms > 0, norms, torch.ones_like(norms))).unsqueeze(1))
        # floor(x + u), u uniform in [0, 1), is floor(x) + 1 with probability frac(x): stochastic rounding
        magnitude.add_(torch.rand(magnitude.shape, generator=generator, dtype=magnitude.dtype)).floor_()
        signed = magnitude.clamp_(max=self.levels).copysign_(rows).to(torch.int8)
        return signed.view(-1), norms

    def dequantize(self, signed: torch.Tensor, norms: torch.Tensor, numel: int) -> torch.Tensor:
        rows = signed.view(-1, self.chunk_size).to(norms.dtype) * (norms / self.levels).unsqueeze(1)
        return rows.view(-1)[:numel]

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        flat = tensor.reshape(-1)
        source = self.state.add_residual(bucket.key, flat) if self.error_feedback else flat
        signed, norms = self.quantize(source, self._rng(bucket.rank))
        if self.error_feedback:
            self.state.keep_residual(bucket.key, source, self.dequantize(signed, norms, flat.numel()))
        return Round("all_gather", [norms, signed], (flat.numel(), tensor.dtype, bucket.divisor))

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        numel, dtype, divisor = ctx
        total = torch.zeros(numel, dtype=dtype)
        for norms, signed in received:  # rank order
            total.add_(self.dequantize(signed, norms, numel))
        return Decoded.done(total / divisor if divisor != 1 else total)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "levels": self.levels, "chunk_size": self.chunk_size, "norm": self.norm,
                "error_feedback": self.error_feedback}
