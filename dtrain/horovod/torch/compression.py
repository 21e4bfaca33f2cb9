"""`horovod.torch.compression`: the `Compressor` base class and `Compression`."""

from __future__ import annotations

from dtrain.horovod.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
