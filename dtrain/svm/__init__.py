"""Support vector machines trained by a distributed SMO with adaptive sample elimination (issue 21).

`SVC` is the scikit-learn-compatible estimator (one process, or every rank of a torch.distributed group);
`SVMTrial` (in `dtrain.svm.trial`) is the built-in Trial an experiment file names to train one with
`dtrain run`. The solver's parts: kernels, sample blocks, the packed exchange, the row cache, the elimination
heuristics, the reconstruction ledger, the SMO loop.
"""

from dtrain.svm.estimator import SVC

__all__ = ["SVC"]
