"""Solve one binary problem over all ranks and gather its model on every rank.

Every rank is given the whole problem (the same X and labels, as every dtrain rank builds the same data set),
takes its block of it, runs the distributed SMO, and receives the support vectors of all ranks in one
all-gather of objects at the end, so that every rank can predict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrain.svm.exchange import PairExchange
from dtrain.svm.samples import SampleBlock, block_range
from dtrain.svm.solver import DistributedSMO, SolverParams, SolverStats


@dataclass
class BinaryModel:
    """The support vectors of one binary problem: indices into its rows, coefficients alpha*y, and rho."""

    support: np.ndarray  # sorted row indices of the problem's samples
    coef: np.ndarray  # alpha_k y_k, same order
    vectors: np.ndarray  # dense features, same order
    rho: float
    dual_objective: float
    stats: list[dict[str, Any]]  # every rank's SolverStats as a dict, in rank order


def make_solver(features: Any, labels: np.ndarray, params: SolverParams, rank: int, world_size: int
                ) -> DistributedSMO:
    """This rank's solver for the problem (features: dense array or CSR; labels in {-1, +1})."""
    start, stop = block_range(len(labels), rank, world_size)
    block = SampleBlock.of(features[start:stop])
    exchange = PairExchange(block.n_features, rank=rank, world_size=world_size,
                            slots=max(params.working_set // 2, 1), mode=params.exchange)
    return DistributedSMO(block, labels[start:stop], start, params, exchange)


def gather_model(solver: DistributedSMO) -> BinaryModel:
    """The whole model on every rank, after `solver.solve()` has returned True (a collective)."""
    rho = solver.rho()
    objective = solver.dual_objective()
    indices, coef, vectors = solver.support()
    parts: list[Any] = solver.exchange.gather_objects((indices, coef, vectors, solver.stats.__dict__.copy()))
    all_indices = np.concatenate([p[0] for p in parts])
    order = np.argsort(all_indices, kind="stable")
    return BinaryModel(support=all_indices[order],
                       coef=np.concatenate([p[1] for p in parts])[order],
                       vectors=np.concatenate([p[2] for p in parts])[order],
                       rho=rho, dual_objective=objective, stats=[p[3] for p in parts])


def solve_binary(features: Any, labels: np.ndarray, params: SolverParams, rank: int = 0, world_size: int = 1
                 ) -> tuple[BinaryModel, SolverStats]:
    """Train one binary SVM over all ranks; (the model, this rank's stats)."""
    solver = make_solver(features, labels, params, rank, world_size)
    solver.solve()
    solver.exchange.close()
    return gather_model(solver), solver.stats
