r"""One round of AdaQP's bit-width MILP by its LP relaxation, rounded and certified; pure numpy.

One round of the MILP of :mod:`~lightning_fullgraph.comm.policies.adaqp.milp` is a set of
multiple-choice knapsacks (one per pair ``k`` of the round) coupled by the round's time ``Z``::

    minimise   sum_g c[j_g, g]  +  w * Z
    subject to beta_k + sum_{g in k} a[j_g, g] <= Z        for every pair k of the round

where group ``g`` picks one option ``j_g`` (a bit-width; ``a`` its modelled link time,
increasing in ``j``; ``c`` its weighted variance, decreasing in ``j``) and ``w >= 0`` is the
weight of the time term.  HiGHS solves it as a MILP with ``B * G`` binaries, which at an
ogbn-products-sized graph (~20,000 groups a key) takes seconds.  Its structure gives the LP
relaxation in closed form:

* Per group, the relaxation only ever uses the options on the lower convex hull of
  ``(a_j, c_j)``; moving from one hull vertex to the next is an *increment* with time
  ``da > 0``, gain ``dc >= 0`` and efficiency ``e = dc / da``, non-increasing along the hull.
* Per pair, with a time budget ``b = Z - L_k`` (``L_k = beta_k + sum_g a_0``, every group at
  its cheapest option) the relaxed knapsack takes the pair's increments by decreasing
  efficiency until the budget is spent (the Dantzig bound of the multiple-choice knapsack;
  at most one increment is taken fractionally).  Its value ``V_k(Z)`` is convex and
  piecewise linear in ``Z`` with slope ``-e`` of the increment being filled.
* The round's relaxation ``phi(Z) = w * Z + sum_k V_k(Z)`` is convex; it is minimal at the
  first breakpoint ``Z*`` (from ``Z_min = max_k L_k``) where ``sum_k e_k(Z+) <= w``.
  ``phi(Z*)`` is a lower bound on the round's MILP optimum.

Rounding: at a candidate ``Z`` every pair keeps the increments that fit entirely, which is
feasible with the round time ``max_k`` (its load) ``<= Z``.  Candidates are ``Z*`` and every
pair's breakpoints just below and just above it; the cheapest integer objective wins.  Its
distance to ``phi(Z*)`` certifies it: :func:`solve_round_relaxed` returns both, and the
caller accepts the rounding only when ``upper - lower <= mip_rel_gap * (upper - floor)``
(HiGHS' criterion, ``mip_rel_gap * |upper|``, made stricter: ``floor`` removes the offset that
no choice changes), otherwise it solves the round as a MILP.  The rounding gives
up at most one increment per pair against the relaxation, so the gap shrinks as the groups
per pair grow: exactly where the MILP is slow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["RoundSolution", "round_floor", "solve_round_relaxed"]


@dataclass(frozen=True)
class RoundSolution:
    """Outcome of :func:`solve_round_relaxed`.

    Attributes:
        choice: option index per group of the round, int64 ``[L]`` (into the ``B`` options).
        lower: the LP relaxation's optimum (a lower bound on the round's MILP objective).
        upper: the MILP objective of ``choice`` (``sum c + w * max_k load_k``).
        floor: each term at its own minimum (every group's cheapest cost plus ``w`` times the
            round time with every group at its fastest option), ``<= lower``: the offset the
            objective carries whatever the choice, which a gap is measured above.
    """

    choice: np.ndarray
    lower: float
    upper: float
    floor: float

    def within(self, rel_gap: float) -> bool:
        """Whether ``choice`` is certified within ``rel_gap`` of the optimum, above the floor.

        ``upper - lower <= rel_gap * (upper - floor)``: stricter than HiGHS' test
        (``rel_gap * |upper|``), whose ``|upper|`` includes the floor, which in AdaQP's objective
        (the variance at the widest bits plus the time at the narrowest) can dwarf the part
        the choice decides.
        """
        return self.upper - self.lower <= rel_gap * (self.upper - self.floor)


def _hull_increments(
    a: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Increments along each group's lower convex hull of its ``(a_j, c_j)`` options.

    Args:
        a: option times, float64 ``[B, L]`` (non-decreasing in ``j``).
        c: option costs, float64 ``[B, L]``.

    Returns:
        ``(group, to, da, dc, eff)`` per increment, group-major and in hull order within a
        group: the group index, the option index it moves to, its time, its gain and its
        efficiency ``dc / da``.  An increment of zero time and positive gain comes first
        (efficiency ``inf``); options that do not lower the cost are never reached.
    """
    n_opt, n_grp = a.shape
    cur = np.zeros(n_grp, dtype=np.int64)
    cols = np.arange(n_grp)
    groups, tos, das, dcs, effs = [], [], [], [], []
    for _ in range(n_opt - 1):
        a_cur, c_cur = a[cur, cols], c[cur, cols]
        da = a - a_cur[None, :]
        dc = c_cur[None, :] - c
        ahead = np.arange(n_opt)[:, None] > cur[None, :]
        useful = ahead & (dc > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            eff = np.where(da > 0, dc / np.where(da > 0, da, 1.0), np.inf)
        eff = np.where(useful, eff, -np.inf)
        # the most efficient next vertex; on a tie the nearest, which keeps increments small
        nxt = np.argmax(eff, axis=0)
        moves = eff[nxt, cols] > -np.inf
        if not moves.any():
            break
        g = cols[moves]
        groups.append(g)
        tos.append(nxt[moves])
        das.append(np.maximum(da[nxt[moves], g], 0.0))
        dcs.append(dc[nxt[moves], g])
        effs.append(eff[nxt[moves], g])
        cur = np.where(moves, nxt, cur)
    if not groups:
        empty = np.zeros(0)
        return empty.astype(np.int64), empty.astype(np.int64), empty, empty, empty
    group = np.concatenate(groups)
    order = np.lexsort((np.arange(group.size), group))  # group-major, hull order kept
    return tuple(np.concatenate(t)[order] for t in (groups, tos, das, dcs, effs))


def round_floor(
    cost: np.ndarray, time: np.ndarray, pair: np.ndarray, beta: np.ndarray
) -> tuple[np.ndarray, float]:
    """What no choice changes in one round: every group's cheapest cost, ``[L]``, and the
    round's least time ``max_k (beta_k + sum_{g in k} time[0, g])`` (every group at its
    fastest option).  The floor of the objective is ``sum(cheapest) + w * least_time``; the
    certificate here and HiGHS' gap (``milp._solve_round``) are both measured above it."""
    load = beta.astype(np.float64) + np.bincount(pair, weights=time[0], minlength=beta.size)
    return cost.min(axis=0), float(load.max())


def solve_round_relaxed(
    cost: np.ndarray, time: np.ndarray, pair: np.ndarray, beta: np.ndarray, w: float
) -> RoundSolution:
    """Solves one round's LP relaxation exactly and rounds it (module docstring).

    Args:
        cost: ``c``, each option's objective cost per group, float64 ``[B, L]`` (``>= 0``).
        time: ``a``, each option's link time per group, float64 ``[B, L]``, non-decreasing
            in the option index (the same unit as ``beta``).
        pair: the round's pair index of each group, int64 ``[L]`` in ``[0, K)``.
        beta: each pair's fixed time, float64 ``[K]``.
        w: the weight of the round time ``Z`` in the objective (``>= 0``).

    Returns:
        A :class:`RoundSolution`.
    """
    n_opt, n_grp = cost.shape
    n_pair = beta.size
    group, to, da, dc, eff = _hull_increments(time, cost)
    # float noise must not let an increment overtake an earlier one of its group in the sort
    # below (increments are group-major, at most B - 1 per group)
    same = np.zeros(group.size, dtype=bool)
    same[1:] = group[1:] == group[:-1]
    for _ in range(n_opt - 2):
        eff = np.where(same, np.minimum(eff, np.r_[np.inf, eff[:-1]]), eff)
    base_load = beta.astype(np.float64) + np.bincount(pair, weights=time[0], minlength=n_pair)
    base_cost = float(cost[0].sum())

    # per pair: increments by decreasing efficiency (ties: hull order), cumulative time and gain
    inc_pair = pair[group]
    order = np.lexsort((np.arange(group.size), -eff, inc_pair))
    inc_pair, group, to, da, dc, eff = (t[order] for t in (inc_pair, group, to, da, dc, eff))
    bounds = np.searchsorted(inc_pair, np.arange(n_pair + 1))
    cum_a = [np.cumsum(da[bounds[k] : bounds[k + 1]]) for k in range(n_pair)]
    cum_c = [np.cumsum(dc[bounds[k] : bounds[k + 1]]) for k in range(n_pair)]
    effs = [eff[bounds[k] : bounds[k + 1]] for k in range(n_pair)]

    # each pair's breakpoints in round time; counting against these very values (not
    # against z - L_k) keeps a breakpoint's own increment counted despite rounding
    ends = [base_load[k] + cum_a[k] for k in range(n_pair)]
    z_min = float(base_load.max())
    breaks = np.unique(np.concatenate([[z_min], *ends]))
    breaks = breaks[breaks >= z_min]

    def taken(z: np.ndarray) -> list[np.ndarray]:
        """Per pair, the increments that fit entirely at each round time in ``z``."""
        return [np.searchsorted(ends[k], z, side="right") for k in range(n_pair)]

    # the relaxation's slope right of each breakpoint: w - sum_k e_k(Z+)
    slope = np.full(breaks.size, float(w))
    for k, m in enumerate(taken(breaks)):
        e = effs[k]
        if e.size:
            slope -= np.where(m < e.size, e[np.minimum(m, e.size - 1)], 0.0)
    at = int(np.argmax(slope >= 0)) if (slope >= 0).any() else breaks.size - 1
    z_star = float(breaks[at])

    lower = float(w) * z_star + base_cost
    for k, m in enumerate(taken(np.array([z_star]))):
        m = int(m[0])
        if m:
            lower -= float(cum_c[k][m - 1])
        if m < effs[k].size:
            spent = float(cum_a[k][m - 1]) if m else 0.0
            lower -= float(effs[k][m]) * (z_star - base_load[k] - spent)

    # rounding: Z* and its neighbouring breakpoints; the cheapest integer objective wins
    cand = breaks[max(at - n_pair, 0) : at + n_pair + 1]
    counts = taken(cand)
    obj = np.full(cand.size, base_cost)
    load = np.tile(base_load[:, None], (1, cand.size))
    for k, m in enumerate(counts):
        has = m > 0
        idx = np.maximum(m - 1, 0)
        if cum_c[k].size:
            obj -= np.where(has, cum_c[k][idx], 0.0)
            load[k] += np.where(has, cum_a[k][idx], 0.0)
    obj += float(w) * load.max(axis=0)
    best = int(np.argmin(obj))
    choice = np.zeros(n_grp, dtype=np.int64)
    for k, m in enumerate(counts):
        sl = slice(bounds[k], bounds[k] + int(m[best]))
        np.maximum.at(choice, group[sl], to[sl])
    cheapest, least_time = round_floor(cost, time, pair, beta)
    floor = float(cheapest.sum()) + float(w) * least_time
    return RoundSolution(choice=choice, lower=lower, upper=float(obj[best]), floor=floor)
