"""Datasets (Fashion-MNIST, digits, synthetic) and the per-rank sharding of training batches."""

from dtrain.data.arrays import ArrayDataset
from dtrain.data.digits import load_digits
from dtrain.data.fashion_mnist import load_fashion_mnist
from dtrain.data.sharding import BatchSplit, ShardedBatchSampler, split_by_sizes, split_global_batch
from dtrain.data.synthetic import synthetic_classification, synthetic_like, synthetic_regression

__all__ = ["ArrayDataset", "BatchSplit", "ShardedBatchSampler", "load_digits", "load_fashion_mnist",
           "split_by_sizes", "split_global_batch", "synthetic_classification", "synthetic_like",
           "synthetic_regression"]
