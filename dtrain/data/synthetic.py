"""Synthetic data of any shape, learnable, generated in memory: tells compute from the input pipeline."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.data.arrays import ArrayDataset


def synthetic_classification(num_records: int, input_shape: Sequence[int], num_classes: int, seed: int = 0,
                             dtype: torch.dtype = torch.float32) -> ArrayDataset:
    """Gaussian inputs labelled by a fixed random linear teacher, so that a model can learn them."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((num_records, *input_shape), generator=generator, dtype=torch.float64)
    teacher = torch.randn((int(torch.tensor(input_shape).prod()), num_classes), generator=generator,
                          dtype=torch.float64)
    labels = (inputs.flatten(1) @ teacher).argmax(dim=1)
    return ArrayDataset(inputs.to(dtype), labels)


def synthetic_regression(num_records: int, num_features: int, num_outputs: int = 1, seed: int = 0,
                         noise: float = 0.1, dtype: torch.dtype = torch.float32) -> ArrayDataset:
    """Inputs and targets of a random linear map plus noise."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((num_records, num_features), generator=generator, dtype=torch.float64)
    weights = torch.randn((num_features, num_outputs), generator=generator, dtype=torch.float64)
    targets = inputs @ weights + noise * torch.randn((num_records, num_outputs), generator=generator,
                                                     dtype=torch.float64)
    return ArrayDataset(inputs.to(dtype), targets.to(dtype))


def synthetic_like(sample: Sequence[torch.Tensor], num_records: int, seed: int = 0) -> ArrayDataset:
    """Random tensors with the shapes and dtypes of one record (e.g. `dataset[0]`), integer ones kept in range."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for item in sample:
        item = torch.as_tensor(item)
        shape = (num_records, *item.shape)
        if item.dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator, dtype=torch.float64).to(item.dtype))
        else:
            high = max(int(item.max()) + 1, 2)
            tensors.append(torch.randint(0, high, shape, generator=generator).to(item.dtype))
    return ArrayDataset(*tensors)
