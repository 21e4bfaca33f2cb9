"""The q-variable subproblem of one round, solved the same way on every rank (no communication).

With a working set B of q samples (the q/2 most violating of each side over all ranks), the dual restricted to
B, with the other alphas fixed, is a small QP whose gradient is f_B and whose Hessian is y_B y_B' K_BB. It is
solved by the same maximal-violating-pair SMO steps as the full problem, on q-sized arrays, until its own gap
is below `inner_tol` or after `max_steps` steps. Its first step is the full problem's maximal violating pair
(B holds both global extremes), so every round makes at least the progress of one pair iteration; the rest of
the round's steps cost no collective and no pass over the ranks' samples.
"""

from __future__ import annotations

import numpy as np

TAU = 1e-12  # libsvm's floor for a non-positive curvature along the pair direction


def pair_step(a_i: float, a_j: float, y_i: float, y_j: float, c_i: float, c_j: float, gap: float, eta: float
              ) -> tuple[float, float, float]:
    """The clipped step t along (alpha_i += y_i t, alpha_j -= y_j t) for f_j - f_i = gap > 0: (t, new a_i, new a_j).

    A step that reaches a bound lands on it exactly, so that the index sets stay exact."""
    t = gap / (eta if eta > 0 else TAU)
    room_i = c_i - a_i if y_i > 0 else a_i
    room_j = a_j if y_j > 0 else c_j - a_j
    t = min(t, room_i, room_j)
    new_i = a_i + y_i * t
    new_j = a_j - y_j * t
    if t == room_i:
        new_i = c_i if y_i > 0 else 0.0
    if t == room_j:
        new_j = 0.0 if y_j > 0 else c_j
    return t, new_i, new_j


def solve_subproblem(alpha: np.ndarray, f: np.ndarray, y: np.ndarray, bound: np.ndarray, gram: np.ndarray,
                     inner_tol: float, max_steps: int) -> int:
    """Improve `alpha` (and `f`) of the working set in place; return the pair steps taken."""
    up_pen = np.empty(len(alpha))
    low_pen = np.empty(len(alpha))
    work = np.empty(len(alpha))
    positive = y > 0
    steps = 0
    while steps < max_steps:
        up = np.where(positive, alpha < bound, alpha > 0)
        low = np.where(positive, alpha > 0, alpha < bound)
        np.copyto(up_pen, np.where(up, 0.0, np.inf))
        np.copyto(low_pen, np.where(low, 0.0, -np.inf))
        np.add(f, up_pen, out=work)
        i = int(np.argmin(work))
        f_i = work[i]
        np.add(f, low_pen, out=work)
        j = int(np.argmax(work))
        gap = work[j] - f_i
        if not gap > inner_tol:
            break
        eta = gram[i, i] + gram[j, j] - 2.0 * gram[i, j]
        t, alpha[i], alpha[j] = pair_step(alpha[i], alpha[j], y[i], y[j], bound[i], bound[j], gap, eta)
        np.subtract(gram[i], gram[j], out=work)
        work *= t
        f += work
        steps += 1
    return steps
