"""Top-k sparsification with error feedback (Strom 2015; Aji & Heafield 2017; Stich et al. 2018) and the
sparsity warm-up of Deep Gradient Compression (Lin et al., ICLR 2018, arXiv:1712.01887).

Each step a = g + e; the k = ratio * n entries of largest |a| are sent as (value, int32 index) pairs and
e = a - sent keeps the rest for later steps, so nothing is lost, only delayed. Ranks pick different indices,
so the pairs are all-gathered (8k bytes per rank) and every rank adds them up. With `warmup_steps`, the
density falls geometrically from `warmup_start_ratio` to `ratio` over those steps (DGC: 25 % -> 6.25 % ->
... over the first epochs).

Finding the k largest of millions of entries with torch.topk costs tens of ms on a CPU; like DGC we estimate
a threshold from a sample, keep the candidates above it and run topk on those only. When at least k entries
pass the threshold the result is exactly torch.topk's set; otherwise the full topk runs.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.compress.base import BucketInfo, Compressor, Decoded, Round

_SAMPLE = 20_000  # entries sampled to estimate the threshold
_SLACK = 1.5  # aim the threshold at 1.5 k candidates so that at least k pass it


def top_k_indices(values: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of the k entries of largest magnitude (any order), exactly as torch.topk would pick them."""
    magnitude = values.abs()
    n = magnitude.numel()
    if k >= n:
        return torch.arange(n)
    if n > 4 * _SAMPLE and k * 4 < n:
        sample = magnitude[torch.randint(n, (_SAMPLE,), generator=generator)]
        keep = max(1, min(_SAMPLE, int(_SAMPLE * _SLACK * k / n)))
        threshold = sample.kthvalue(_SAMPLE - keep + 1).values
        candidates = (magnitude >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:
            best = torch.topk(magnitude[candidates], k, sorted=False).indices
            return candidates[best]
    return torch.topk(magnitude, k, sorted=False).indices


class TopK(Compressor):
    name = "topk"

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, warmup_steps: int = 0,
                 warmup_start_ratio: float = 0.25, seed: int = 0) -> None:
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"topk ratio {ratio} must be in (0, 1]")
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.warmup_steps = warmup_steps
        self.warmup_start_ratio = max(warmup_start_ratio, ratio)
        self._generator = torch.Generator().manual_seed(seed)

    def density(self, step: int) -> float:
        """The fraction of entries sent at communicating step `step` (0-based)."""
        if step >= self.warmup_steps:
            return self.ratio
        return float(self.warmup_start_ratio * (self.ratio / self.warmup_start_ratio) ** (step / self.warmup_steps))

    def k_for(self, numel: int, step: int) -> int:
        return max(1, min(numel, round(self.density(step) * numel)))

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Round:
        flat = tensor.reshape(-1)
        accumulated = self.state.add_residual(bucket.key, flat) if self.error_feedback else flat
        indices = top_k_indices(accumulated, self.k_for(flat.numel(), self.state.steps), self._generator)
        values = accumulated[indices]
        if self.error_feedback:  # the residual is what was not sent: the accumulated gradient, sent entries zeroed
            accumulated[indices] = 0
            self.state.residuals[bucket.key] = accumulated
        return Round("all_gather", [values, indices.to(torch.int32)], (flat, bucket.divisor))

    def decompress(self, received: Any, ctx: Any) -> Decoded:
        """The sum of every rank's entries, written into the bucket itself (it is no longer needed)."""
        out, divisor = ctx
        out.zero_()
        for values, indices in received:
            out.index_add_(0, indices.to(torch.int64), values / divisor if divisor != 1 else values)
        return Decoded.done(out)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio, "error_feedback": self.error_feedback,
                "warmup_steps": self.warmup_steps, "warmup_start_ratio": self.warmup_start_ratio}
