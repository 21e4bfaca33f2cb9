"""Distributed SMO in Keerthi's form over block-partitioned samples, with adaptive elimination.

The dual: minimise 1/2 a'Qa - e'a subject to 0 <= a_k <= C_k and y'a = 0, with Q_kl = y_k y_l K(x_k, x_l).
Each rank keeps, for its own samples, the error cache f_k = sum_l a_l y_l K_kl - y_k (= y_k times the dual
gradient). With I_up = {y=+1, a<C} u {y=-1, a>0} and I_low = {y=+1, a>0} u {y=-1, a<C}, the extremes are
b_up = min_{I_up} f and b_low = max_{I_low} f, and the solution is optimal within tol when
b_low <= b_up + 2 tau, with 2 tau = tol (libsvm's and scikit-learn's stopping rule, so results compare).

One iteration (every rank, in lockstep):
1. the local extremes of the active samples, packed with their data, in ONE all-gather (`exchange.py`);
2. every rank picks the same maximal violating pair (i = argmin f over I_up, j = argmax f over I_low) and the
   same analytic two-variable step t (clipped to the box);
3. every rank updates its f with two kernel rows over its active samples (cached: `cache.py`); the owners of i
   and j update their alphas.
Every `policy.every` iterations a rank eliminates samples by the heuristic (`elimination.py`). When the
active set has converged, every rank rebuilds the f of its eliminated samples from the ledger (`ledger.py`),
the ranks agree on the gap over ALL samples, false positives (eliminated samples that violate) come back, and
SMO continues; it ends when the gap over all samples is within tol.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtrain.svm.cache import KernelRowCache
from dtrain.svm.elimination import EliminationPolicy
from dtrain.svm.exchange import ALPHA, BOUND, FIELDS, INDEX, KDIAG, LABEL, PairExchange
from dtrain.svm.exchange import F as FVAL
from dtrain.svm.kernels import Kernel
from dtrain.svm.ledger import Ledger
from dtrain.svm.samples import SampleBlock
from dtrain.svm.subproblem import pair_step, solve_subproblem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SolverParams:
    """What defines the problem and how the solver works on it."""

    kernel: Kernel
    C: float = 1.0
    tol: float = 1e-3
    class_weight: tuple[float, float] = (1.0, 1.0)  # multiplies C for y = -1 and y = +1
    cache_bytes: int = 200 * 2**20
    max_iter: int = -1
    working_set: int = 2  # q: 2 is the paper's pair per collective; larger batches pair steps per collective
    inner_steps: int = 1000  # most pair steps of one working-set subproblem
    exchange: str = "auto"  # the per-iteration all-gather: auto, gloo or shm (dtrain.comm.shm)
    policy: EliminationPolicy = field(default_factory=lambda: EliminationPolicy("none"))


@dataclass
class SolverStats:
    """Counters of one rank (eliminations are this rank's; the rest are the same on every rank)."""

    iterations: int = 0  # pair updates (SMO steps)
    rounds: int = 0  # collectives of the SMO loop (= iterations with a working set of 2)
    kernel_evaluations: int = 0  # this rank's kernel values computed (rows and reconstruction)
    rows_computed: int = 0
    eliminated: int = 0  # samples this rank eliminated (events)
    reactivated: int = 0  # of those, found violating at a recheck and brought back (false positives)
    rechecks: int = 0
    min_active: int = 0
    comm_seconds: float = 0.0
    solve_seconds: float = 0.0
    check_seconds: float = 0.0  # elimination checks and the compactions they caused
    reconstruct_seconds: float = 0.0  # bringing eliminated samples' f up to date (rechecks, checkpoints)
    cache_hits: int = 0
    cache_misses: int = 0
    final_gap: float = float("nan")
    converged: bool = False
    exchange: str = "local"  # how the per-iteration all-gather went: local (one rank), gloo or shm


class DistributedSMO:
    """This rank's part of one binary SVM problem: samples `block` with labels y in {-1, +1} at global indices
    [start, start + len(block))."""

    def __init__(self, block: SampleBlock, y: np.ndarray, start: int, params: SolverParams,
                 exchange: PairExchange) -> None:
        self.block = block
        self.y = np.asarray(y, dtype=np.float64)
        self.start = start
        self.params = params
        self.kernel = params.kernel
        self.exchange = exchange
        self.policy = params.policy
        n = len(block)
        self.bound = np.where(self.y > 0, params.C * params.class_weight[1], params.C * params.class_weight[0])
        self.kdiag = self.kernel.diagonal(block.sq_norms)
        self.alpha = np.zeros(n)
        self.f = -self.y.copy()
        self.active = np.ones(n, dtype=bool)
        self.streak = np.zeros(n, dtype=np.int64)
        self.stats = SolverStats(min_active=n, exchange=exchange.mode)
        self.ledger = Ledger()
        self.cache = KernelRowCache(params.cache_bytes)
        self.b_up, self.b_low = -1.0, 1.0
        self.done = False
        self._compact()

    # ------------------------------------------------------------------ the compacted active set

    def _compact(self) -> None:
        """Rebuild the working arrays from the full ones for the current active set."""
        self.pos = np.flatnonzero(self.active)
        self.xa = self.block.subset(self.pos) if len(self.pos) < len(self.block) else self.block
        self.fa = self.f[self.pos].copy()
        self.aa = self.alpha[self.pos].copy()
        self.ya = self.y[self.pos]
        self.ca = self.bound[self.pos]
        self.kda = self.kdiag[self.pos]
        self.where = np.full(len(self.block), -1, dtype=np.int64)
        self.where[self.pos] = np.arange(len(self.pos))
        positive = self.ya > 0
        in_up = np.where(positive, self.aa < self.ca, self.aa > 0)
        in_low = np.where(positive, self.aa > 0, self.aa < self.ca)
        self.pen_up = np.where(in_up, 0.0, np.inf)
        self.pen_low = np.where(in_low, 0.0, -np.inf)
        self.buf = np.empty(len(self.pos))
        self.stats.min_active = min(self.stats.min_active, len(self.pos))

    def _set_pens(self, c: int) -> None:
        """Sample c's index-set penalties after its alpha moved: `_compact`'s rule for one sample (scalar, as it runs
        twice per iteration)."""
        a, y, bound = self.aa[c], self.ya[c], self.ca[c]
        self.pen_up[c] = 0.0 if (a < bound if y > 0 else a > 0) else np.inf
        self.pen_low[c] = 0.0 if (a > 0 if y > 0 else a < bound) else -np.inf

    def _write_back(self) -> None:
        self.f[self.pos] = self.fa
        self.alpha[self.pos] = self.aa

    # ------------------------------------------------------------------ one round

    def _pack(self) -> None:
        """Fill the exchange buffer with this rank's candidates: the `slots` smallest f of I_up, then the `slots`
        largest f of I_low, each with its data."""
        send, slots = self.exchange.send, self.exchange.slots
        n = len(self.fa)
        if slots == 1 and n:
            self._pack_pair(send)
            return
        for side, pen in ((0, self.pen_up), (1, self.pen_low)):
            rows = send[side * slots:(side + 1) * slots]
            rows[:, INDEX] = -1.0
            rows[:, FVAL] = np.inf if side == 0 else -np.inf
            if n == 0:
                continue
            np.add(self.fa, pen, out=self.buf)
            if side == 1:
                np.negative(self.buf, out=self.buf)
            k = min(slots, n)
            picked = np.argpartition(self.buf, k - 1)[:k] if k < n else np.arange(n)
            picked = picked[np.argsort(self.buf[picked], kind="stable")]
            for r, c in enumerate(picked):
                if not np.isfinite(self.buf[c]):
                    break
                self._fill_candidate(rows[r], int(c))

    def _pack_pair(self, send: np.ndarray) -> None:
        """`_pack` for one candidate per side (the pair algorithm): an argmin and an argmax, no sorting."""
        buf = self.buf
        np.add(self.fa, self.pen_up, out=buf)
        up = int(buf.argmin())
        f_up = buf[up]
        np.add(self.fa, self.pen_low, out=buf)
        low = int(buf.argmax())
        f_low = buf[low]
        for side, c, found in ((0, up, f_up < np.inf), (1, low, f_low > -np.inf)):
            row = send[side]
            if not found:
                row[INDEX], row[FVAL] = -1.0, (np.inf if side == 0 else -np.inf)
                continue
            self._fill_candidate(row, c)

    def _fill_candidate(self, row: np.ndarray, c: int) -> None:
        """One exchange row for active sample c: its f, global index, alpha, label, bound, K(x, x) and features."""
        row[FVAL], row[INDEX], row[ALPHA] = self.fa[c], self.start + self.pos[c], self.aa[c]
        row[LABEL], row[BOUND], row[KDIAG] = self.ya[c], self.ca[c], self.kda[c]
        self.xa.dense_row(c, row[FIELDS:])

    def _row(self, index: int, x: np.ndarray) -> np.ndarray:
        """K(x_index, active samples of this rank), from the cache or computed (and cached)."""
        row = self.cache.get(index)
        if row is not None:
            return row
        x_sq = float(x @ x)
        row = self.kernel.from_dots(self.xa.dots(x), x_sq, self.xa.sq_norms)
        self.stats.kernel_evaluations += len(row)
        self.stats.rows_computed += 1
        self.cache.put(index, row)
        return row

    def _apply(self, index: int, x: np.ndarray, coef: float, alpha: float) -> None:
        """f += coef K(x_index, .) on this rank's active samples; the owner stores the new alpha."""
        np.multiply(self._row(index, x), coef, out=self.buf)
        self.fa += self.buf
        local = index - self.start
        if 0 <= local < len(self.block):
            c = int(self.where[local])
            self.aa[c] = alpha
            self._set_pens(c)
        if self.policy.enabled:
            self.ledger.record(index, coef, x)

    def _step(self, table: np.ndarray) -> bool:
        """One pair iteration from the gathered `table` (one candidate per side per rank); False when the
        active set has converged."""
        slots = self.exchange.slots
        r_up = int(np.argmin(table[:, 0, FVAL]))
        r_low = int(np.argmax(table[:, slots, FVAL]))
        up, low = table[r_up, 0], table[r_low, slots]
        self.b_up, self.b_low = float(up[FVAL]), float(low[FVAL])
        if not self.b_low > self.b_up + self.params.tol:
            return False
        x_i, x_j = up[FIELDS:], low[FIELDS:]
        eta = up[KDIAG] + low[KDIAG] - 2.0 * self.kernel.pair(x_i, x_j)
        t, new_i, new_j = pair_step(up[ALPHA], low[ALPHA], up[LABEL], low[LABEL], up[BOUND], low[BOUND],
                                    self.b_low - self.b_up, eta)
        self._apply(int(up[INDEX]), x_i, t, new_i)
        self._apply(int(low[INDEX]), x_j, -t, new_j)
        self.stats.iterations += 1
        return True

    def _round(self, table: np.ndarray) -> bool:
        """One working-set round: the q/2 most violating samples of each side over all ranks, the subproblem
        solved identically on every rank, f updated with the rows of the samples whose alpha moved."""
        slots = self.exchange.slots
        ups = table[:, :slots].reshape(-1, table.shape[2])
        lows = table[:, slots:].reshape(-1, table.shape[2])
        ups = ups[ups[:, INDEX] >= 0]
        lows = lows[lows[:, INDEX] >= 0]
        self.b_up = float(ups[:, FVAL].min()) if len(ups) else np.inf
        self.b_low = float(lows[:, FVAL].max()) if len(lows) else -np.inf
        if not self.b_low > self.b_up + self.params.tol:
            return False
        ups = ups[np.lexsort((ups[:, INDEX], ups[:, FVAL]))[:slots]]
        lows = lows[np.lexsort((lows[:, INDEX], -lows[:, FVAL]))[:slots]]
        both = np.concatenate([ups, lows])
        _, first = np.unique(both[:, INDEX], return_index=True)  # sorted by global index: the same for any W
        ws = both[first]
        x = ws[:, FIELDS:]
        alpha = ws[:, ALPHA].copy()
        f = ws[:, FVAL].copy()
        gram = self.kernel.block(x, x)
        inner_tol = max(self.params.tol, 0.1 * (self.b_low - self.b_up))
        steps = solve_subproblem(alpha, f, ws[:, LABEL], ws[:, BOUND], gram, inner_tol, self.params.inner_steps)
        moved = np.flatnonzero(alpha != ws[:, ALPHA])
        for k in moved:
            self._apply(int(ws[k, INDEX]), x[k], (alpha[k] - ws[k, ALPHA]) * ws[k, LABEL], float(alpha[k]))
        self.stats.iterations += max(steps, 1)
        return True

    # ------------------------------------------------------------------ elimination and recheck

    def _eliminate(self) -> None:
        started = time.perf_counter()
        streak = self.streak[self.pos]
        chosen = self.policy.select(self.fa, self.pen_up, self.pen_low, self.b_up, self.b_low, streak)
        self.streak[self.pos] = streak
        if chosen.any():
            self._write_back()
            gone = self.pos[chosen]
            self.active[gone] = False
            self.ledger.open_epoch(gone)
            self.stats.eliminated += len(gone)
            self.cache.compact(np.flatnonzero(~chosen))
            self._compact()
        self.stats.check_seconds += time.perf_counter() - started

    def refresh(self) -> None:
        """Bring the f of every eliminated sample up to date (no communication)."""
        started = time.perf_counter()
        self._write_back()
        self.stats.kernel_evaluations += self.ledger.reconstruct(self.f, self.block.dense_rows, self.kernel)
        self.stats.reconstruct_seconds += time.perf_counter() - started

    def _extremes_all(self) -> tuple[float, float]:
        """(b_up, b_low) over all of this rank's samples, eliminated ones included (f must be current)."""
        a, y, bound = self.alpha, self.y, self.bound
        up = np.where(y > 0, a < bound, a > 0)
        low = np.where(y > 0, a > 0, a < bound)
        b_up = float(self.f[up].min()) if up.any() else np.inf
        b_low = float(self.f[low].max()) if low.any() else -np.inf
        return b_up, b_low

    def _recheck(self) -> bool:
        """At convergence of the active set: rebuild, agree on the gap over all samples, bring back violators.
        True when the solve is over (gap over all samples within tol)."""
        self.stats.rechecks += 1
        self.refresh()
        b_up, b_low = self._extremes_all()
        reduced = self.exchange.reduce(np.array([b_up, -b_low]), "min")
        b_up, b_low = float(reduced[0]), -float(reduced[1])
        self.stats.final_gap = b_low - b_up
        if not b_low > b_up + self.params.tol:
            return True
        tol = self.params.tol
        a, y, bound, f = self.alpha, self.y, self.bound, self.f
        up = np.where(y > 0, a < bound, a > 0)
        low = np.where(y > 0, a > 0, a < bound)
        back = ~self.active & ((up & (f < b_low - tol)) | (low & (f > b_up + tol)))
        if back.any():
            positions = np.flatnonzero(back)
            self.active[positions] = True
            self.streak[positions] = 0
            self.ledger.drop(positions)
            self.stats.reactivated += len(positions)
            self.cache.clear()
            self._compact()
        return False

    # ------------------------------------------------------------------ the loop

    def solve(self, max_iterations: int | None = None) -> bool:
        """Run SMO until the solution is optimal within tol (True) or `max_iterations` more iterations (or the
        total `max_iter`) have run (False); call again to continue."""
        started = time.perf_counter()
        comm_before = self.exchange.seconds
        limit = None if max_iterations is None else self.stats.iterations + max_iterations
        try:
            while not self.done:
                if limit is not None and self.stats.iterations >= limit:
                    break
                if 0 <= self.params.max_iter <= self.stats.iterations:
                    log.warning("SMO stopped at max_iter=%d before reaching tol", self.params.max_iter)
                    break
                self._pack()
                table = self.exchange.gather()
                self.stats.rounds += 1
                before = self.stats.iterations
                if not (self._step(table) if self.exchange.slots == 1 else self._round(table)):
                    self.done = self._recheck()
                    continue
                if self.policy.due(before, self.stats.iterations):
                    self._eliminate()
        finally:
            self._write_back()
            self.stats.solve_seconds += time.perf_counter() - started
            self.stats.comm_seconds += self.exchange.seconds - comm_before
            self.stats.cache_hits, self.stats.cache_misses = self.cache.hits, self.cache.misses
        self.stats.converged = self.done
        return self.done

    # ------------------------------------------------------------------ results

    def rho(self) -> float:
        """libsvm's rho (the decision is sum a y K - rho): the mean f over free SVs of all ranks, else the
        middle of the bounded ones' range. f must be current (after `solve` or `refresh`)."""
        a, y, bound, f = self.alpha, self.y, self.bound, self.f
        free = (a > 0) & (a < bound)
        at_upper = a >= bound
        ub_set = (at_upper & (y < 0)) | ((a <= 0) & (y > 0))
        lb_set = (at_upper & (y > 0)) | ((a <= 0) & (y < 0))
        ub = float(f[ub_set].min()) if ub_set.any() else np.inf
        lb = float(f[lb_set].max()) if lb_set.any() else -np.inf
        sums = self.exchange.reduce(np.array([float(f[free].sum()), float(free.sum())]), "sum")
        bounds = self.exchange.reduce(np.array([ub, -lb]), "min")
        if sums[1] > 0:
            return float(sums[0] / sums[1])
        return float((bounds[0] - bounds[1]) / 2)

    def dual_objective(self) -> float:
        """1/2 a'Qa - e'a over all samples (libsvm's sign: the minimised value), from f."""
        local = 0.5 * float(np.sum(self.alpha * self.y * self.f)) - 0.5 * float(self.alpha.sum())
        return float(self.exchange.reduce(np.array([local]), "sum")[0])

    def support(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's support vectors: (global indices, alpha * y, dense features)."""
        sv = np.flatnonzero(self.alpha > 0)
        return sv + self.start, self.alpha[sv] * self.y[sv], self.block.dense_rows(sv)

    # ------------------------------------------------------------------ checkpoints

    def local_state(self) -> dict[str, Any]:
        """What this rank contributes to a checkpoint (its f brought up to date first)."""
        self.refresh()
        return {"start": self.start, "alpha": self.alpha.copy(), "f": self.f.copy(), "active": self.active.copy(),
                "streak": self.streak.copy(), "stats": self.stats.__dict__.copy(), "done": self.done}

    def load_global(self, alpha: np.ndarray, f: np.ndarray, active: np.ndarray, streak: np.ndarray,
                    iterations: int, done: bool) -> None:
        """Resume from full-length arrays (this rank takes its block; any world size)."""
        stop = self.start + len(self.block)
        self.alpha = np.array(alpha[self.start:stop], dtype=np.float64)
        self.f = np.array(f[self.start:stop], dtype=np.float64)
        self.active = np.array(active[self.start:stop], dtype=bool)
        self.streak = np.array(streak[self.start:stop], dtype=np.int64)
        self.stats.iterations = iterations
        self.done = done
        self.ledger = Ledger()
        eliminated = np.flatnonzero(~self.active)
        if len(eliminated):
            self.ledger.open_epoch(eliminated)
        self.cache.clear()
        self._compact()
