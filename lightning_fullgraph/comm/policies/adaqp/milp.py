r"""AdaQP's bit-width assignment (arXiv 2306.01381): cost model, row groups and the MILP, pure.

Pure functions only: nothing here touches a process group.  The distributed driver
(:func:`lightning_fullgraph.comm.policies.adaqp.distributed.assign_message_bits`) is "one rank solves, all
receive": every rank groups the rows it sends, rank 0 gathers all ranks' groups, builds ONE
:class:`AssignmentProblem` per key ``(layer, "forward" | "backward")`` over *all* senders,
calls :func:`assign_bits` on it, and broadcasts the chosen bit-widths.
:meth:`AssignmentProblem.for_sender` builds a single-sender problem (tests, what-if
comparisons); it ignores the other senders' links in each round's maximum.

Link cost model
---------------
Per directed rank pair ``s -> p`` a message of ``n`` bytes takes
``t(n) = alpha * n + beta`` seconds (``alpha`` in s/byte, ``beta`` in s):
:class:`~lightning_fullgraph.comm.policies.adaqp.links.LinkCost`, profiled and fitted by
:mod:`~lightning_fullgraph.comm.policies.adaqp.links` (the one home of the fit rule).

Variance model
--------------
A row ``i`` with ``F`` features quantised to ``b`` bits by stochastic min/max rounding has
(weighted) variance ``c_i / (2^b - 1)^2`` with ``c_i = w_i * F * (max_i - min_i)^2 / 6``
(:func:`variance_coefficients`; ``w_i`` is the squared aggregation score computed by the
receiver).  The constant factor is irrelevant: the objective is normalised.

Grouping
--------
The rows a sender sends to one peer are sorted by ``c_i`` (descending, stable) and chopped
into groups of ``group_size`` rows (the last group may be smaller); a group gets one
bit-width (:func:`group_nodes`, :func:`group_aggregates`, :func:`build_problem`).  Groups never
mix (sender, peer) pairs.

The MILP (one per key, joint over all senders)
----------------------------------------------
Groups ``g = 0..G-1`` with sender ``s_g``, peer ``p_g``, ``n_g`` rows and variance coefficient
``C_g = sum_{i in g} c_i``; bit choices ``b in B`` (default ``{2, 4, 8}``); bytes per row
``R(b) = ceil(F * b / 8) + m`` (``m`` = metadata bytes per row; default the codec's
:data:`~lightning_fullgraph.comm.quantize.META_NBYTES`).
Communication round ``r = 1..W-1``: every rank ``s`` sends to ``(s + r) mod W``, so the pair
``s -> p`` belongs to round ``r(s, p) = (p - s) mod W``.

Variables: binary ``x[b, g]``, continuous ``Z_r >= 0``::

    sum_b x[b, g] = 1                                                  for every g
    alpha_{s,p} * sum_{g in (s->p)} sum_b x[b,g] * n_g * R(b) + beta_{s,p} <= Z_{r(s,p)}
                                                  for every pair (s, p) that has a group

    V(x) = sum_g sum_b x[b, g] * C_g / (2^b - 1)^2        (total variance)
    T(x) = sum_r Z_r                                      (estimated exchange time, s)

    minimise  lambda * (V - V_lo) / (V_hi - V_lo)  +  (1 - lambda) * (T - T_lo) / (T_hi - T_lo)

Normalisation: ``V_lo = V(all max bits)``, ``V_hi = V(all min bits)``,
``T_lo = T(all min bits)``, ``T_hi = T(all max bits)`` (with ``Z_r`` at its tightest value,
``max`` over the round's pairs, 0 for a round without pairs).  ``V`` is decreasing and ``T``
increasing in every ``x``'s bit-width, so both normalised terms lie in ``[0, 1]`` and so does
the objective.  A term whose range is zero (e.g. all-zero variance, or ``alpha = 0``
everywhere, or a single bit choice) is constant; its normalised value is defined as 0 and
its weight in the MILP is 0.  A pair that has no group sends nothing and adds no
constraint.

In MILP form the constants drop out: ``c[x[b, g]] = w_V * C_g / (2^b - 1)^2`` with
``w_V = lambda / (V_hi - V_lo)`` and ``c[Z_r] = w_T = (1 - lambda) / (T_hi - T_lo)``.  Times inside
the MILP are rescaled by ``T_hi`` for conditioning.

Solving: every pair belongs to exactly one round and ``Z_r`` couples only that round's
pairs, so the MILP separates exactly into independent per-round MILPs, one per round that
has a group (at most ``W - 1`` rounds, at most ``W`` pairs each), solved one by one.  With
``solver="auto"`` (default) a round is first solved by its LP relaxation, in closed form, and
rounded (:mod:`~lightning_fullgraph.comm.policies.adaqp.relaxation`: milliseconds where HiGHS
takes seconds at ~20,000 groups a key); the rounding is kept when its distance to the
relaxation's bound is within ``mip_rel_gap`` of the part of the objective the choice decides
(the round's objective minus its *floor*: every group at its least variance and the round at
its least time); at the default gap (:data:`MIP_REL_GAP`, 1 %) that held for every measured
round of about 100 groups or more.  Other rounds (and every round with ``solver="highs"``)
go to ``scipy.optimize.milp`` (HiGHS), sharing the time budget, with the floor shifted out
of the objective so that HiGHS' relative gap measures the same quantity (measured against
the raw objective, which in a latency-dominated round is almost all floor, HiGHS stopped at
0.147 where the optimum is 0.124).  A round that stops at
its time limit keeps HiGHS' incumbent
(``status="time_limit"``); a round whose solve fails, raises, or stops without an incumbent
falls back (``status="fallback"``, the message names the rounds): with ``improve=False`` to
uniform max bits (AdaQP's pre-assignment schedule), otherwise to the best of a greedy
descent (below) started from each uniform bit-width (max bits first, winning ties).

Ties and refinement: with ``lambda = 0`` the bits of a pair that is not its round's
bottleneck do not change the objective (likewise zero-variance groups for any ``lambda``).
Unless ``improve=False``, a coordinate descent on the exact objective runs afterwards: each
group takes its best bit-width given the others, moving only on a strict decrease or, on a
tie, to fewer bits.  It never increases the objective, so it keeps optimal solutions optimal
(breaking ties towards fewer bytes), improves time-limited incumbents and turns the
fallback into a greedy assignment (descent can stall where several pairs share a round's
maximum, so the greedy fallback is typically a few points of objective above the optimum).

Reported ``variance``, ``round_times``, ``est_time`` and ``objective`` are always recomputed
from the chosen bits, never read from the solver's ``Z``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
from scipy.optimize import Bounds, LinearConstraint, milp
from torch import Tensor

from lightning_fullgraph.comm.policies.adaqp.links import LinkCost
from lightning_fullgraph.comm.policies.adaqp.relaxation import round_floor, solve_round_relaxed
from lightning_fullgraph.comm.quantize import META_NBYTES

__all__ = [
    "ADAPTIVE_BITS",
    "MIP_REL_GAP",
    "SOLVERS",
    "AssignmentProblem",
    "AssignmentResult",
    "assign_bits",
    "build_problem",
    "evaluate_bits",
    "expand_group_bits",
    "group_aggregates",
    "group_nodes",
    "range_coefficients",
    "variance_coefficients",
]

#: The widths AdaQP's bit assignment chooses from (the paper's {2, 4, 8}; a subset of the
#: quantizer's :data:`~lightning_fullgraph.comm.quantize.SUPPORTED_BITS`): one home for this
#: MILP, its distributed driver and the policy.
ADAPTIVE_BITS: tuple[int, ...] = (2, 4, 8)

#: :func:`assign_bits`' default relative gap (of the part of the objective the choice decides,
#: module docstring).  1 %: on the 12 problems of an adaqp run on the 54.6 %-halo benchmark
#: graph (4 ranks, ~110 groups a round) the rounded relaxation certified at 1e-2 had the proven
#: optimum's objective and bits on every one, in 5-43 ms, where HiGHS took 0.1-1.3 s per key to
#: certify 1e-3 (2.3-3.1 s of every assignment); the objective's inputs (range-based variances,
#: a profiled link cost) are far less certain than 1 %.
MIP_REL_GAP: float = 1e-2

#: How :func:`assign_bits` solves a round: ``"auto"`` rounds the round's LP relaxation and
#: keeps it where its certified gap is within ``mip_rel_gap`` (HiGHS otherwise); ``"highs"``
#: always solves the MILP with HiGHS.
SOLVERS: tuple[str, ...] = ("auto", "highs")

Pair = tuple[int, int]


# --------------------------------------------------------------------------- variance / groups


def range_coefficients(row_range: Tensor, feature_dim: int) -> Tensor:
    """``F * range_i^2 / 6`` (float64, ``[M]``): AdaQP's variance model at one level
    (:func:`~lightning_fullgraph.comm.quantize.adaqp_variance_model` times ``(2^b - 1)^2``);
    the one place the coefficient is written down."""
    return float(feature_dim) * row_range.detach().to(torch.float64).reshape(-1).square() / 6.0


def variance_coefficients(x: Tensor, weight: Tensor | None = None) -> Tensor:
    """Per-row variance coefficient ``c_i = w_i * F * (max_i - min_i)^2 / 6``.

    The quantisation variance of row ``i`` at ``b`` bits is modelled as ``c_i / (2^b - 1)^2``.

    Args:
        x: rows to be sent, shape ``[M, F]``.
        weight: per-row weight ``w_i`` (squared aggregation score), shape ``[M]``; ``None``
            means 1.

    Returns:
        ``c``, float64, shape ``[M]``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, F], got shape {tuple(x.shape)}")
    m, f = x.shape
    if m == 0 or f == 0:
        return torch.zeros(m, dtype=torch.float64, device=x.device)
    xd = x.detach().to(torch.float64)
    c = range_coefficients(xd.amax(dim=1) - xd.amin(dim=1), f)
    if weight is not None:
        c = c * weight.detach().to(device=c.device, dtype=torch.float64).reshape(-1)
    return c


def group_nodes(weighted_variance: Tensor, group_size: int) -> Tensor:
    """Assign rows to groups of ``group_size`` by descending weighted variance.

    Rows are sorted by ``weighted_variance`` descending with a stable sort (ties keep their
    original order), so the result is deterministic; the first ``group_size`` rows of that
    order form group 0, and so on; the last group may be smaller.

    Args:
        weighted_variance: per-row weighted variance coefficient, shape ``[M]``.
        group_size: rows per group, ``>= 1``.

    Returns:
        Group id per row, int64, shape ``[M]``, values in ``[0, ceil(M / group_size))``;
        group 0 holds the highest-variance rows.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    v = weighted_variance.detach().reshape(-1)
    m = v.numel()
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=v.device)
    order = torch.sort(v, descending=True, stable=True).indices
    group_ids = torch.empty(m, dtype=torch.long, device=v.device)
    group_ids[order] = torch.arange(m, device=v.device) // group_size
    return group_ids


def group_aggregates(
    weighted_variance: Tensor, group_ids: Tensor, num_groups: int | None = None
) -> tuple[Tensor, Tensor]:
    """Per-group row counts and variance sums.

    Args:
        weighted_variance: per-row ``c_i``, shape ``[M]``.
        group_ids: per-row group id, int64, shape ``[M]``.
        num_groups: number of groups ``G``; default ``max(group_ids) + 1``.

    Returns:
        ``(rows, var_coef)``: int64 ``[G]`` row counts and float64 ``[G]`` sums of ``c_i``.
    """
    gid = group_ids.reshape(-1).long()
    v = weighted_variance.detach().reshape(-1).to(torch.float64)
    if gid.numel() != v.numel():
        raise ValueError("weighted_variance and group_ids differ in length")
    if num_groups is None:
        num_groups = int(gid.max()) + 1 if gid.numel() else 0
    if gid.numel() and (int(gid.min()) < 0 or int(gid.max()) >= num_groups):
        raise ValueError(f"group ids must lie in [0, {num_groups})")
    rows = torch.bincount(gid, minlength=num_groups)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=v.device).index_add_(0, gid, v)
    return rows.long(), sums


def expand_group_bits(group_ids: Tensor, bits_per_group: Tensor) -> Tensor:
    """Per-row bit-widths from per-group bit-widths.

    Args:
        group_ids: per-row group id (global, as returned by :func:`build_problem`), ``[M]``.
        bits_per_group: bit-width per group, ``[G]``.

    Returns:
        ``bits_per_group[group_ids]``, shape ``[M]``, on ``group_ids``' device.
    """
    return bits_per_group.to(group_ids.device)[group_ids.long()]


# --------------------------------------------------------------------------- problem / result


def _as_1d(v: Tensor | Sequence[float], dtype: torch.dtype) -> Tensor:
    t = v.detach().cpu() if isinstance(v, Tensor) else torch.as_tensor(v)
    return t.reshape(-1).to(dtype)


@dataclass
class AssignmentProblem:
    """One bit-width assignment problem (one (layer, direction) key), joint over all senders.

    Attributes (``G`` groups; sequences are converted to CPU tensors):
        sender: sending rank per group, int64 ``[G]``.
        peer: destination rank per group, int64 ``[G]`` (``peer != sender``).
        rows: rows per group, int64 ``[G]``.
        var_coef: ``C_g = sum_{i in g} c_i``, float64 ``[G]``; variance at ``b`` bits is
            ``C_g / (2^b - 1)^2``.
        costs: :class:`LinkCost` per ``(sender, peer)``; every pair that has a group needs one.
        world_size: number of ranks ``W``.
        feature_dim: features per row ``F``.
        meta_bytes_per_row: metadata bytes sent with every row (default
            :data:`~lightning_fullgraph.comm.quantize.META_NBYTES`, the codec's).
    """

    sender: Tensor
    peer: Tensor
    rows: Tensor
    var_coef: Tensor
    costs: Mapping[Pair, LinkCost]
    world_size: int
    feature_dim: int
    meta_bytes_per_row: float = float(META_NBYTES)

    def __post_init__(self) -> None:
        self.sender = _as_1d(self.sender, torch.long)
        self.peer = _as_1d(self.peer, torch.long)
        self.rows = _as_1d(self.rows, torch.long)
        self.var_coef = _as_1d(self.var_coef, torch.float64)
        self.costs = {(int(s), int(p)): c for (s, p), c in dict(self.costs).items()}
        g = self.sender.numel()
        if not (self.peer.numel() == self.rows.numel() == self.var_coef.numel() == g):
            raise ValueError("sender, peer, rows and var_coef must have the same length")
        w = int(self.world_size)
        if w < 1:
            raise ValueError(f"world_size must be >= 1, got {w}")
        if g:
            for name, t in (("sender", self.sender), ("peer", self.peer)):
                if int(t.min()) < 0 or int(t.max()) >= w:
                    raise ValueError(f"{name} ids must lie in [0, {w})")
            if bool((self.sender == self.peer).any()):
                raise ValueError("a group cannot be sent to its own sender")
            if int(self.rows.min()) < 0:
                raise ValueError("rows must be non-negative")
            if not bool(torch.isfinite(self.var_coef).all()) or float(self.var_coef.min()) < 0:
                raise ValueError("var_coef must be finite and non-negative")
        for s, p in self.pairs():
            if (s, p) not in self.costs:
                raise ValueError(f"no LinkCost for pair ({s}, {p})")
        if self.feature_dim < 0 or self.meta_bytes_per_row < 0:
            raise ValueError("feature_dim and meta_bytes_per_row must be non-negative")

    @classmethod
    def for_sender(
        cls,
        rank: int,
        peer: Tensor | Sequence[int],
        rows: Tensor | Sequence[int],
        var_coef: Tensor | Sequence[float],
        costs: Mapping[int, LinkCost],
        world_size: int,
        feature_dim: int,
        meta_bytes_per_row: float = float(META_NBYTES),
    ) -> AssignmentProblem:
        """Single-sender problem (rank ``rank`` solves for its own sends); ``costs`` keyed by peer."""
        peer_t = _as_1d(peer, torch.long)
        return cls(
            sender=torch.full_like(peer_t, int(rank)),
            peer=peer_t,
            rows=rows,
            var_coef=var_coef,
            costs={(int(rank), int(p)): c for p, c in costs.items()},
            world_size=world_size,
            feature_dim=feature_dim,
            meta_bytes_per_row=meta_bytes_per_row,
        )

    @property
    def num_groups(self) -> int:
        return int(self.sender.numel())

    def row_bytes(self, bits: int) -> float:
        """Bytes per row at ``bits`` bits: ``ceil(F * bits / 8) + meta_bytes_per_row``."""
        return float(math.ceil(self.feature_dim * int(bits) / 8) + self.meta_bytes_per_row)

    def pairs(self) -> list[Pair]:
        """Sorted distinct ``(sender, peer)`` pairs that have at least one group."""
        if self.num_groups == 0:
            return []
        key = torch.unique(self.sender * self.world_size + self.peer)
        return [(int(k) // self.world_size, int(k) % self.world_size) for k in key]

    def round_of(self, sender: int, peer: int) -> int:
        """Communication round ``(peer - sender) mod W`` (in ``1..W-1``) of a pair."""
        return (int(peer) - int(sender)) % int(self.world_size)


@dataclass
class AssignmentResult:
    """Outcome of :func:`assign_bits` (picklable; tensors on CPU).

    Attributes:
        bits_per_group: chosen bit-width per group, int64 ``[G]``.
        objective: normalised objective of the chosen bits, in ``[0, 1]``.
        variance: total modelled variance ``V`` of the chosen bits.
        est_time: estimated exchange time ``T = sum_r round_times[r]`` in seconds.
        round_times: per round ``r = 1..W-1`` the slowest pair's modelled time, float64
            ``[W - 1]`` (index ``r - 1``).
        solve_seconds: wall time spent building and solving the MILP.
        status: ``"optimal"`` (every round solved to ``mip_rel_gap``, by the certified
            relaxation or by HiGHS), ``"time_limit"``
            (some round kept HiGHS' incumbent), ``"fallback"`` (some round's solve failed; its
            groups got the greedy / uniform-max-bits fallback), ``"empty"`` (no groups) or ``"trivial"``
            (a single bit choice).  Worst status over the rounds wins.
        average_bits: row-weighted mean bit-width (group mean if no rows, 0.0 if no groups).
        norm_variance: normalised variance term in ``[0, 1]``.
        norm_time: normalised time term in ``[0, 1]``.
        message: ``"optimal"`` or, per affected round, the solver message / fallback reason,
            and which rounds the certified relaxation solved.
    """

    bits_per_group: Tensor
    objective: float
    variance: float
    est_time: float
    round_times: Tensor
    solve_seconds: float
    status: str
    average_bits: float
    norm_variance: float = 0.0
    norm_time: float = 0.0
    message: str = ""

    @property
    def used_fallback(self) -> bool:
        return self.status == "fallback"


# --------------------------------------------------------------------------- evaluation


@dataclass
class _Prepared:
    pair_index: np.ndarray  # [G] pair id per group
    pair_round: np.ndarray  # [K] round (1..W-1) per pair
    alpha: np.ndarray  # [K]
    beta: np.ndarray  # [K]
    rows: np.ndarray  # [G] float64
    var_coef: np.ndarray  # [G]


def _prepare(problem: AssignmentProblem) -> _Prepared:
    w = problem.world_size
    key = (problem.sender * w + problem.peer).numpy()
    uniq, inv = np.unique(key, return_inverse=True)
    senders, peers = uniq // w, uniq % w
    costs = [problem.costs[(int(s), int(p))] for s, p in zip(senders, peers)]
    return _Prepared(
        pair_index=inv.reshape(-1),
        pair_round=(peers - senders) % w,
        alpha=np.array([c.alpha for c in costs], dtype=np.float64),
        beta=np.array([c.beta for c in costs], dtype=np.float64),
        rows=problem.rows.numpy().astype(np.float64),
        var_coef=problem.var_coef.numpy(),
    )


def _eval(problem: AssignmentProblem, prep: _Prepared, bits: np.ndarray) -> tuple[float, np.ndarray]:
    """(total variance, per-round times [W-1]) of a per-group bit vector."""
    w = problem.world_size
    bits = bits.astype(np.int64)
    variance = float(np.sum(prep.var_coef / (np.exp2(bits) - 1.0) ** 2))
    row_bytes = np.ceil(problem.feature_dim * bits / 8.0) + problem.meta_bytes_per_row
    traffic = np.bincount(prep.pair_index, weights=prep.rows * row_bytes, minlength=prep.alpha.size)
    pair_time = prep.alpha * traffic + prep.beta
    round_times = np.zeros(max(w - 1, 0), dtype=np.float64)
    if pair_time.size:
        np.maximum.at(round_times, prep.pair_round - 1, pair_time)
    return variance, round_times


def evaluate_bits(problem: AssignmentProblem, bits_per_group: Tensor | Sequence[int]) -> tuple[float, Tensor]:
    """Model a given assignment: total variance and per-round times.

    Args:
        problem: the problem.
        bits_per_group: bit-width per group, ``[G]``.

    Returns:
        ``(variance, round_times)`` with ``round_times`` float64 ``[W - 1]`` (index ``r - 1``),
        each the max over the round's pairs of ``alpha * traffic + beta`` (0 if none).
    """
    bits = _as_1d(bits_per_group, torch.long).numpy()
    if bits.size != problem.num_groups:
        raise ValueError("bits_per_group must have one entry per group")
    v, rt = _eval(problem, _prepare(problem), bits)
    return v, torch.from_numpy(rt)


def _normalised(v: float, lo: float, hi: float) -> float:
    d = hi - lo
    return 0.0 if d <= 0 else float(min(max((v - lo) / d, 0.0), 1.0))


# --------------------------------------------------------------------------- the MILP


def _solve_round(
    sel: np.ndarray,
    prep: _Prepared,
    cost_x: np.ndarray,
    link: np.ndarray,
    cost_z: float,
    beta_scaled: np.ndarray,
    options: dict[str, object],
) -> tuple[np.ndarray | None, int, str]:
    """Solve the MILP restricted to one round's groups ``sel``.

    Returns ``(choice index per group of sel or None, solver status, message)``.
    """
    nb = cost_x.shape[0]
    n_loc = sel.size
    n_x = nb * n_loc
    n_var = n_x + 1  # x[b, l] then Z_r
    pairs, pair_loc = np.unique(prep.pair_index[sel], return_inverse=True)
    pair_loc = pair_loc.reshape(-1)
    n_pairs = pairs.size
    link_loc = link[:, sel]  # [B, L]

    # HiGHS measures its gap relative to |objective|; shift out what no choice changes (each
    # group's cheapest cost, the round's fastest time), so that mip_rel_gap bounds the part
    # the choice decides.  Per-group constants and a shift of Z keep the optimum.
    cheapest, z_floor = round_floor(cost_x[:, sel], link_loc, pair_loc, beta_scaled[pairs])
    c = np.concatenate([(cost_x[:, sel] - cheapest[None, :]).reshape(-1), [cost_z]])
    col_x = np.arange(n_x)
    a_eq = sp.csr_matrix((np.ones(n_x), (np.tile(np.arange(n_loc), nb), col_x)), shape=(n_loc, n_var))
    a_in = sp.csr_matrix(
        (
            np.concatenate([link_loc.reshape(-1), -np.ones(n_pairs)]),
            (
                np.concatenate([np.tile(pair_loc, nb), np.arange(n_pairs)]),
                np.concatenate([col_x, np.full(n_pairs, n_x)]),
            ),
        ),
        shape=(n_pairs, n_var),
    )
    constraints = [
        LinearConstraint(a_eq, np.ones(n_loc), np.ones(n_loc)),
        LinearConstraint(a_in, np.full(n_pairs, -np.inf), z_floor - beta_scaled[pairs]),
    ]
    integrality = np.concatenate([np.ones(n_x), [0.0]])
    bounds = Bounds(np.zeros(n_var), np.concatenate([np.ones(n_x), [np.inf]]))
    try:
        res = milp(c, constraints=constraints, integrality=integrality, bounds=bounds, options=options)
    except Exception as exc:  # any solver failure falls back
        return None, -1, f"milp raised {type(exc).__name__}: {exc}"
    x = getattr(res, "x", None)
    if x is None or res.status not in (0, 1):
        return None, int(res.status), f"milp status {res.status}: {res.message}"
    return np.asarray(x[:n_x]).reshape(nb, n_loc).argmax(axis=0), int(res.status), str(res.message)


def _improve(
    problem: AssignmentProblem,
    prep: _Prepared,
    bits: np.ndarray,
    choices: list[int],
    w_var: float,
    w_time: float,
    max_sweeps: int = 20,
) -> np.ndarray:
    """Coordinate descent on the exact objective; ties go to fewer bits.

    ``w_var`` / ``w_time`` are the objective's weights on raw ``V`` / raw ``T`` (i.e.
    ``lambda / (V_hi - V_lo)`` and ``(1 - lambda) / (T_hi - T_lo)``, 0 for a constant term).
    Sweeps over the groups by ascending ``C``; each group takes the bit-width minimising the
    objective with the others fixed, moving only on a strict decrease or on a tie towards
    fewer bits.  The objective never increases (so an optimum stays optimal, with ties
    broken towards fewer bytes: e.g. non-bottleneck pairs at ``lambda = 0``, zero-variance
    groups), and it terminates (strict decreases or strictly fewer bits).
    """
    bits = bits.astype(np.int64).copy()
    rb = [math.ceil(problem.feature_dim * b / 8) + problem.meta_bytes_per_row for b in choices]
    qs = [1.0 / (2.0**b - 1.0) ** 2 for b in choices]
    idx = {b: i for i, b in enumerate(choices)}
    cur = np.array([idx[int(b)] for b in bits], dtype=np.int64)
    traffic = np.bincount(prep.pair_index, weights=prep.rows * np.asarray(rb)[cur], minlength=prep.alpha.size)
    pair_time = (prep.alpha * traffic + prep.beta).tolist()
    round_pairs: dict[int, list[int]] = {}
    for k, r in enumerate(prep.pair_round.tolist()):
        round_pairs.setdefault(int(r), []).append(k)
    others_of = {
        k: [j for j in round_pairs[int(prep.pair_round[k])] if j != k] for k in range(prep.alpha.size)
    }
    pair_of = prep.pair_index.tolist()
    alpha, rows, var = prep.alpha.tolist(), prep.rows.tolist(), prep.var_coef.tolist()
    order = np.lexsort((np.arange(bits.size), prep.var_coef)).tolist()
    for _ in range(max_sweeps):
        changed = False
        for g in order:
            k, i_cur = pair_of[g], int(cur[g])
            m_other = max((pair_time[j] for j in others_of[k]), default=-math.inf)
            rt_cur = max(pair_time[k], m_other)
            step = alpha[k] * rows[g]
            best_i, best_d, best_pt = i_cur, 0.0, pair_time[k]
            for i in range(len(choices)):
                if i == i_cur:
                    continue
                pt = pair_time[k] + step * (rb[i] - rb[i_cur])
                d = 0.0
                if w_var:
                    d += w_var * var[g] * (qs[i] - qs[i_cur])
                if w_time:
                    d += w_time * (max(pt, m_other) - rt_cur)
                if d < best_d or (d == best_d and i < best_i):
                    best_i, best_d, best_pt = i, d, pt
            if best_i != i_cur:
                cur[g], pair_time[k], changed = best_i, best_pt, True
        if not changed:
            break
    return np.asarray(choices, dtype=np.int64)[cur]


def assign_bits(
    problem: AssignmentProblem,
    lambda_: float = 0.5,
    bit_choices: Sequence[int] = ADAPTIVE_BITS,
    time_limit: float | None = 10.0,
    mip_rel_gap: float = MIP_REL_GAP,
    improve: bool = True,
    solver: str = "auto",
) -> AssignmentResult:
    """Choose one bit-width per group by the AdaQP MILP (see the module docstring).

    The MILP separates exactly by communication round (each pair ``s -> p`` belongs to one
    round and ``Z_r`` couples only that round's pairs), so one small MILP is solved per round;
    the sum of their optima is the joint optimum.

    Args:
        problem: the (joint) problem.
        lambda_: weight of the normalised variance term, in ``[0, 1]``; ``1 - lambda_``
            weighs the normalised time term.
        bit_choices: allowed bit-widths (positive ints; sorted and de-duplicated).
        time_limit: total HiGHS wall-clock budget in seconds over all rounds (``None``: no
            limit); each round gets the remaining budget divided by the rounds left, but at
            least 1 ms (so a tiny budget can be overrun by about 1 ms per round).
        mip_rel_gap: relative gap at which a round is solved: its objective is within
            ``mip_rel_gap`` times the part of it the choice decides (objective minus floor,
            module docstring) of the optimum, for the certified relaxation and for HiGHS
            alike.  ``0`` proves optimality (HiGHS, slower).
        improve: run :func:`_improve` (coordinate descent on the exact objective, ties to
            fewer bits) on the solution: it breaks ties (e.g. non-bottleneck pairs at
            ``lambda_ = 0``, zero-variance groups), improves time-limited incumbents and turns
            the fallback into a greedy one (best descent from each uniform start).  Never
            increases the objective.
        solver: ``"auto"`` (the certified rounding of each round's LP relaxation where it is
            within ``mip_rel_gap``, HiGHS elsewhere) or ``"highs"`` (HiGHS for every round);
            :data:`SOLVERS`.

    Returns:
        An :class:`AssignmentResult`; ``bits_per_group`` is int64 ``[G]`` with values in
        ``bit_choices``.
    """
    t0 = time.perf_counter()
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if not 0.0 <= float(lambda_) <= 1.0:
        raise ValueError(f"lambda_ must lie in [0, 1], got {lambda_}")
    choices = sorted({int(b) for b in bit_choices})
    if not choices or choices[0] < 1:
        raise ValueError(f"bit_choices must be positive ints, got {bit_choices}")
    lam = float(lambda_)
    g_count = problem.num_groups
    b_min, b_max = choices[0], choices[-1]
    prep = _prepare(problem)

    v_hi, rt_hi = _eval(problem, prep, np.full(g_count, b_min))  # max variance, min time
    v_lo, rt_lo = _eval(problem, prep, np.full(g_count, b_max))  # min variance, max time
    t_lo, t_hi = float(rt_hi.sum()), float(rt_lo.sum())
    dv, dt = v_hi - v_lo, t_hi - t_lo
    w_var = lam / dv if (dv > 0 and lam > 0) else 0.0  # objective weight on raw V
    w_time = (1.0 - lam) / dt if (dt > 0 and lam < 1) else 0.0  # objective weight on raw T

    def finish(bits: np.ndarray, status: str, message: str) -> AssignmentResult:
        variance, round_times = _eval(problem, prep, bits)
        est = float(round_times.sum())
        nv, nt = _normalised(variance, v_lo, v_hi), _normalised(est, t_lo, t_hi)
        rows = prep.rows
        if g_count == 0:
            avg = 0.0
        elif rows.sum() > 0:
            avg = float(np.sum(rows * bits) / rows.sum())
        else:
            avg = float(np.mean(bits))
        return AssignmentResult(
            bits_per_group=torch.from_numpy(bits.astype(np.int64)),
            objective=lam * nv + (1.0 - lam) * nt,
            variance=variance,
            est_time=est,
            round_times=torch.from_numpy(round_times),
            solve_seconds=time.perf_counter() - t0,
            status=status,
            average_bits=avg,
            norm_variance=nv,
            norm_time=nt,
            message=message,
        )

    if g_count == 0:
        return finish(np.zeros(0, dtype=np.int64), "empty", "no groups")
    if len(choices) == 1:
        return finish(np.full(g_count, b_min), "trivial", "single bit choice")

    bits_arr = np.asarray(choices, dtype=np.float64)
    inv_q2 = 1.0 / (np.exp2(bits_arr) - 1.0) ** 2  # [B]
    row_bytes = np.ceil(problem.feature_dim * bits_arr / 8.0) + problem.meta_bytes_per_row  # [B]
    tau = t_hi if t_hi > 0 else 1.0  # time unit inside the MILP (conditioning)
    link = (prep.alpha[prep.pair_index] * prep.rows)[None, :] * row_bytes[:, None] / tau  # [B, G]
    cost_x = w_var * inv_q2[:, None] * prep.var_coef[None, :]  # [B, G]
    cost_z = w_time * tau

    group_round = prep.pair_round[prep.pair_index]
    rounds = np.unique(group_round).tolist()
    bits = np.full(g_count, b_max, dtype=np.int64)
    failed = np.zeros(g_count, dtype=bool)
    statuses, messages = [], []
    relaxed = []
    for i, r in enumerate(rounds):
        sel = np.flatnonzero(group_round == r)
        if solver == "auto":
            pairs, pair_loc = np.unique(prep.pair_index[sel], return_inverse=True)
            rounded = solve_round_relaxed(
                cost_x[:, sel], link[:, sel], pair_loc.reshape(-1), prep.beta[pairs] / tau, cost_z
            )
            if rounded.within(mip_rel_gap):
                bits[sel] = np.asarray(choices, dtype=np.int64)[rounded.choice]
                statuses.append("optimal")
                relaxed.append(int(r))
                continue
        options: dict[str, object] = {"disp": False, "mip_rel_gap": float(mip_rel_gap)}
        if time_limit is not None:
            remaining = float(time_limit) - (time.perf_counter() - t0)
            options["time_limit"] = max(remaining / (len(rounds) - i), 1e-3)
        choice, code, msg = _solve_round(sel, prep, cost_x, link, cost_z, prep.beta / tau, options)
        if choice is None:
            failed[sel] = True
            statuses.append("fallback")
            how = "greedy descent from the best uniform start" if improve else f"uniform {b_max} bits"
            messages.append(f"round {r}: {msg}; fell back to {how}")
            continue
        bits[sel] = np.asarray(choices, dtype=np.int64)[choice]
        statuses.append("optimal" if code == 0 else "time_limit")
        if code != 0:
            messages.append(f"round {r}: {msg}")
    if improve:
        # failed rounds: descend from every uniform start, keep the best (max bits wins ties)
        starts = [b_max] + choices[:-1] if failed.any() else [b_max]
        best_bits, best_obj = bits, math.inf
        for b0 in starts:
            cand = np.where(failed, b0, bits)
            cand = _improve(problem, prep, cand, choices, w_var, w_time)
            variance, round_times = _eval(problem, prep, cand)
            obj = lam * _normalised(variance, v_lo, v_hi) + (1 - lam) * _normalised(
                float(round_times.sum()), t_lo, t_hi
            )
            if obj < best_obj:
                best_bits, best_obj = cand, obj
        bits = best_bits
    status = next((s for s in ("fallback", "time_limit") if s in statuses), "optimal")
    if relaxed:
        messages.append(f"rounds {relaxed}: rounded LP relaxation within mip_rel_gap")
    return finish(bits, status, "; ".join(messages) or "optimal")


# --------------------------------------------------------------------------- building problems


def build_problem(
    weighted_variance: Mapping[Pair, Tensor],
    group_size: int,
    costs: Mapping[Pair, LinkCost],
    world_size: int,
    feature_dim: int,
    meta_bytes_per_row: float = float(META_NBYTES),
) -> tuple[AssignmentProblem, dict[Pair, Tensor]]:
    """Group every pair's rows and assemble the joint problem.

    Args:
        weighted_variance: per ``(sender, peer)`` the rows' ``c_i`` in send order, ``[M_sp]``.
        group_size: rows per group (:func:`group_nodes`).
        costs: :class:`LinkCost` per ``(sender, peer)``.
        world_size: ``W``.
        feature_dim: ``F``.
        meta_bytes_per_row: metadata bytes per row.

    Returns:
        ``(problem, group_ids)`` where ``group_ids[(s, p)]`` (int64 ``[M_sp]``) maps each row
        of that pair to its *global* group index in ``problem``, so
        ``expand_group_bits(group_ids[(s, p)], result.bits_per_group)`` gives per-row bits.
        Pairs are laid out in sorted ``(sender, peer)`` order; empty pairs get no group.
    """
    senders, peers, rows, var_coef = [], [], [], []
    group_ids: dict[Pair, Tensor] = {}
    offset = 0
    for s, p in sorted((int(s), int(p)) for s, p in weighted_variance):
        v = weighted_variance[(s, p)].detach().cpu().reshape(-1)
        gid = group_nodes(v, group_size)
        n = int(gid.max()) + 1 if gid.numel() else 0
        r, cv = group_aggregates(v, gid, n)
        senders.append(torch.full((n,), s, dtype=torch.long))
        peers.append(torch.full((n,), p, dtype=torch.long))
        rows.append(r)
        var_coef.append(cv)
        group_ids[(s, p)] = gid + offset
        offset += n

    def cat(ts: list[Tensor], dtype: torch.dtype) -> Tensor:
        return torch.cat(ts) if ts else torch.zeros(0, dtype=dtype)

    problem = AssignmentProblem(
        sender=cat(senders, torch.long),
        peer=cat(peers, torch.long),
        rows=cat(rows, torch.long),
        var_coef=cat(var_coef, torch.float64),
        costs=costs,
        world_size=world_size,
        feature_dim=feature_dim,
        meta_bytes_per_row=meta_bytes_per_row,
    )
    return problem, group_ids
