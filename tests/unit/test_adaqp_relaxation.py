"""One round of the bit-width MILP by its LP relaxation: the bound, the rounding, the certificate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import linprog

from lightning_fullgraph.comm.policies.adaqp.relaxation import solve_round_relaxed


def _round(seed: int, groups: int, pairs: int, options: int = 3, convex: bool = False):
    """A random round: option times increasing, costs decreasing; non-convex unless asked."""
    rng = np.random.default_rng(seed)
    pair = rng.integers(0, pairs, groups)
    pair[:pairs] = np.arange(pairs)  # every pair has a group
    if convex:  # AdaQP's shape: cost ~ C / (2^b - 1)^2, time ~ alpha * rows * bytes(b)
        bits = np.array([2, 4, 8][:options], dtype=np.float64)
        c = rng.lognormal(0, 2, groups)[None, :] / (2**bits[:, None] - 1) ** 2
        a = rng.uniform(0.5, 2, pairs)[pair][None, :] * rng.integers(5, 100, groups)[None, :] * (bits[:, None] * 8 + 8)
    else:
        a = np.cumsum(rng.uniform(0.0, 1.0, (options, groups)), axis=0)
        a[:, rng.random(groups) < 0.1] += 0.0  # keep some equal-time neighbours below
        a[1, :3] = a[0, :3]  # zero-time increments exist
        c = np.cumsum(rng.uniform(0.0, 1.0, (options, groups))[::-1], axis=0)[::-1]
    beta = rng.uniform(0.0, 2.0, pairs)
    return c, a, pair, beta


def _lp_value(c, a, pair, beta, w) -> float:
    """The round's LP relaxation by a general LP solver (x in [0, 1], one row of x per group)."""
    n_opt, n_grp = c.shape
    n_x = n_opt * n_grp
    obj = np.r_[c.T.reshape(-1), w]
    a_eq = np.zeros((n_grp, n_x + 1))
    for g in range(n_grp):
        a_eq[g, g * n_opt : (g + 1) * n_opt] = 1.0
    n_pair = beta.size
    a_ub = np.zeros((n_pair, n_x + 1))
    for g in range(n_grp):
        a_ub[pair[g], g * n_opt : (g + 1) * n_opt] = a[:, g]
    a_ub[:, -1] = -1.0
    res = linprog(obj, A_ub=a_ub, b_ub=-beta, A_eq=a_eq, b_eq=np.ones(n_grp),
                  bounds=[(0, 1)] * n_x + [(0, None)], method="highs")
    assert res.status == 0
    return float(res.fun)


def _integer_objective(c, a, pair, beta, w, choice) -> float:
    cols = np.arange(c.shape[1])
    load = beta + np.bincount(pair, weights=a[choice, cols], minlength=beta.size)
    return float(c[choice, cols].sum() + w * load.max())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("w", [0.0, 0.3, 3.0, 50.0])
@pytest.mark.parametrize("convex", [False, True])
def test_the_lower_bound_is_the_lp_relaxation(seed: int, w: float, convex: bool) -> None:
    """``lower`` equals a general LP solver's optimum of the same relaxation, on rounds with
    options off the convex hull, zero-time increments, several pairs and every weight of the
    time term (0: time is free).  Negative controls: taking the options in index order instead
    of along the hull, or stopping at the first breakpoint instead of where the slope turns,
    gives a different value and fails."""
    c, a, pair, beta = _round(seed, groups=40, pairs=3, convex=convex)
    if convex:
        w = w / 50.0 * float(c.sum()) / float(a.sum())  # a weight at the scale of the problem
    sol = solve_round_relaxed(c, a, pair, beta, w)
    assert sol.lower == pytest.approx(_lp_value(c, a, pair, beta, w), rel=1e-9, abs=1e-9)
    assert sol.floor <= sol.lower + 1e-12 <= sol.upper + 2e-12


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("w", [0.2, 1.0, 5.0])
def test_the_rounding_is_feasible_and_brackets_the_optimum(seed: int, w: float) -> None:
    """On rounds small enough to enumerate: ``upper`` is exactly the objective of ``choice``
    (computed here from the choice, not read back), the enumerated optimum lies between
    ``lower`` and ``upper``, and a certificate at gap 0 is given only to the optimum.
    Negative control: an ``upper`` read from the relaxation, or a rounding that overfills a
    pair (its load above the bound's ``Z``), breaks one of the three."""
    c, a, pair, beta = _round(seed, groups=7, pairs=2)
    sol = solve_round_relaxed(c, a, pair, beta, w)
    assert sol.upper == pytest.approx(_integer_objective(c, a, pair, beta, w, sol.choice), rel=1e-12)
    best = min(
        _integer_objective(c, a, pair, beta, w, np.array(ch)) for ch in itertools.product(range(3), repeat=7)
    )
    assert sol.lower <= best + 1e-12 <= sol.upper + 2e-12
    if sol.within(0.0):
        assert sol.upper == pytest.approx(best, rel=1e-12)


def test_the_certificate_is_measured_above_the_floor() -> None:
    """A round whose objective is mostly offset (large fixed link times): ``within`` compares
    the gap with ``upper - floor``, not with ``|upper|``, so a rounding that gives up a tenth
    of what the choice decides is not certified at 1e-3.  Negative control: HiGHS' own test
    (``gap <= 1e-3 * |upper|``) certifies it."""
    c, a, pair, beta = _round(3, groups=6, pairs=2, convex=True)
    w = float(c.sum()) / float(a.sum())
    beta = np.full(beta.size, 1e3 * float(a.sum()))  # the round time is almost all latency
    sol = solve_round_relaxed(c, a, pair, beta, w)
    gap = sol.upper - sol.lower
    assert gap > 0
    assert gap <= 1e-3 * abs(sol.upper)  # HiGHS' test would accept it
    assert gap > 1e-3 * (sol.upper - sol.floor)
    assert not sol.within(1e-3)
