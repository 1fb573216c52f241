r"""AdaQP's link cost model, pure: probe sizes over a link's real messages, a checked alpha-beta fit.

Nothing here touches a process group; the timed exchanges are
:func:`lightning_fullgraph.comm.policies.adaqp.distributed.profile_links`.

Model
-----
A message of ``n`` bytes on the directed link ``s -> p`` takes::

    t(n) = alpha * n + beta          alpha [s / byte] > 0,  beta [s] >= 0

(:class:`LinkCost`).  Units are **bytes and seconds** everywhere (AdaQP's ``profile.py`` uses
MB and ms; only the units differ).  The assignment's round time is the max over the round's
links of ``t``, so the profile decides which pairs can afford more bits; a per-link noise in
``alpha`` becomes a difference in bits (the issue that motivated this module: identical
loopback links fitted from 4 sizes x 3 repeats gave 6.5 mean bits against 3.3 with equal
costs).

Profile (as AdaQP's ``profile.py``: many sizes over each pair's real message range)
------------------------------------------------------------------------------------
:func:`probe_sizes`: ``count`` sizes, evenly spaced over ``[lo / 2, hi + lo / 2]`` where
``lo`` / ``hi`` are the smallest / largest message the link will carry (rows sent to that
peer times the bytes of a row at the fewest / most bits, over every layer width and
direction), capped at ``max_bytes`` (the model is linear, so larger messages are
extrapolated).  The caller times every size ``repeats`` times.

Fit and checks (:func:`fit_link`)
---------------------------------
1. The median time per distinct size (robust to the odd descheduled repeat).
2. Least squares ``t = alpha * n + beta`` on the medians, and ``R^2``, the share of the
   medians' variance the line explains.
3. ``alpha <= 0``: **rejected** (time does not grow with size: the probe saw noise only).
4. ``beta < 0`` (latency below what the probe resolves): **refitted** with ``beta = 0``
   (non-negative least squares, :func:`fit_alpha_beta`), its ``R^2`` recomputed.
5. ``R^2 < min_r2``: **rejected** (the line explains too little of the medians).

Resolving a profile (:func:`resolve_links`)
-------------------------------------------
* The **pooled fit**: every link's samples in one fit (same rule).  It is the reference
  of "the same link".
* A link whose own fit is rejected takes the pooled fit (one note naming the link and why).
* A link whose own fit stays, over its probed range, within ``tolerance`` times the pooled
  fit's time for the link's largest probe is **indistinguishable** from the pool and takes
  the pooled fit too.  (The scale is the largest message: a latency small against a whole
  message cannot move a round's maximum much, and the intercept is the noisiest part of a
  fit.)  On identical links the assignment then sees identical costs, and since a common
  ``alpha`` and ``beta`` cancel from the normalised objective it solves the same problem
  as with ``link_costs="uniform"``, instead of bits that follow which link happened to be
  descheduled.  A link that differs by more (a slower NIC, another machine: typically
  several-fold) keeps its own fit.
* If the pooled fit itself is rejected and most links' own fits are accepted (links too
  different for one line), accepted own fits stay and a rejected link takes the median
  ``alpha`` and ``beta`` of the accepted links.  If at most half the links are accepted
  (the probe saw noise: messages too small against the host's jitter), every link gets
  :data:`NOMINAL_COST` (the costs of ``link_costs="uniform"``), with one note: a few links
  that pass by chance must not make the others look slow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

__all__ = [
    "NOMINAL_COST",
    "LinkCost",
    "LinkFit",
    "ResolvedLinks",
    "fit_alpha_beta",
    "fit_link",
    "message_range",
    "probe_sizes",
    "resolve_links",
]

Pair = tuple[int, int]


@dataclass(frozen=True)
class LinkCost:
    """Linear cost of one message on a directed link: ``t = alpha * nbytes + beta``.

    Attributes:
        alpha: seconds per byte (``>= 0``).
        beta: fixed latency in seconds (``>= 0``).
    """

    alpha: float
    beta: float

    def time(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """Predicted seconds for a message of ``nbytes`` bytes (scalar or array; a tensor works too)."""
        return self.alpha * nbytes + self.beta


#: The nominal link of ``link_costs="uniform"`` (1 GB/s, 0.1 ms) and the fallback when no
#: measured fit is physical.  On identical links only the costs' equality matters (a common
#: ``alpha`` and ``beta`` cancel from the normalised objective).
NOMINAL_COST = LinkCost(alpha=1e-9, beta=1e-4)


def _check_samples(x: np.ndarray, t: np.ndarray) -> None:
    if x.shape != t.shape:
        raise ValueError(f"sizes_bytes and seconds differ in length: {x.size} vs {t.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ValueError("sizes_bytes and seconds must be finite")
    if np.any(x < 0) or np.any(t < 0):
        raise ValueError("sizes_bytes and seconds must be non-negative")
    if np.unique(x).size < 2:
        raise ValueError("a link fit needs at least two distinct message sizes")


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> LinkCost:
    """Fit ``t = alpha * bytes + beta`` with ``alpha, beta >= 0`` by non-negative least squares.

    Uses ``scipy.optimize.nnls`` on ``[bytes / max(bytes), 1] @ [a, beta] = t`` (the size
    column is scaled for conditioning, then ``alpha = a / max(bytes)``).  The constraint is
    exact NNLS, not clipping of an unconstrained fit: when the unconstrained slope or
    intercept would be negative the other coefficient is refitted.  No physical check: see
    :func:`fit_link` for the fit the profile uses.

    Args:
        sizes_bytes: message sizes in bytes, shape ``[K]``.
        seconds: measured times in seconds, shape ``[K]``.

    Returns:
        The fitted :class:`LinkCost` (``alpha`` in s/byte, ``beta`` in s).

    Raises:
        ValueError: on mismatched lengths, non-finite or negative values, or fewer than two
            distinct sizes (the fit would be underdetermined).
    """
    x = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
    t = np.asarray(seconds, dtype=np.float64).reshape(-1)
    _check_samples(x, t)
    scale = float(x.max())
    a = np.stack([x / scale, np.ones_like(x)], axis=1)
    coef, _ = nnls(a, t)
    return LinkCost(alpha=float(coef[0]) / scale, beta=float(coef[1]))


def probe_sizes(lo_bytes: float, hi_bytes: float, count: int, max_bytes: int) -> list[int]:
    """Message sizes that span a link's real messages (AdaQP's ``profile.py`` range).

    ``count`` sizes evenly spaced over ``[lo / 2, hi + lo / 2]`` (``lo`` / ``hi``: the
    smallest / largest message the link carries), the top end capped at ``max_bytes`` (and
    the range over ``[max_bytes / 2, max_bytes]`` if it lies wholly above it); duplicates
    after rounding are dropped (only for ranges of fewer than ``count`` bytes).

    Args:
        lo_bytes: smallest message of the link, bytes (``> 0``).
        hi_bytes: largest message, bytes (``>= lo_bytes``).
        count: sizes wanted (``>= 2``).
        max_bytes: cap on one probe message, bytes (``>= 2``): bounds the profile's time.

    Returns:
        Ascending distinct sizes in bytes, at least two.
    """
    if count < 2 or max_bytes < 2:
        raise ValueError(f"count and max_bytes must be >= 2, got {count} and {max_bytes}")
    if not (0 < lo_bytes <= hi_bytes) or not np.isfinite(hi_bytes):
        raise ValueError(f"need 0 < lo_bytes <= hi_bytes, got {lo_bytes} and {hi_bytes}")
    top = min(hi_bytes + lo_bytes / 2.0, float(max_bytes))
    bottom = max(lo_bytes / 2.0, 1.0)
    if bottom >= top:  # the whole range above the cap (or one byte): keep a range to fit
        bottom = max(top / 2.0, 1.0)
    sizes = sorted({int(round(s)) for s in np.linspace(bottom, top, count)})
    return sizes if len(sizes) >= 2 else [sizes[0], sizes[0] + 1]


def message_range(
    rows: Mapping[object, Sequence[int]],
    feature_dims: Mapping[object, int],
    bit_choices: Sequence[int],
    meta_bytes_per_row: float,
) -> list[tuple[float, float]]:
    """The smallest and largest message each outgoing link of one rank carries, bytes.

    A row of ``F`` features at ``b`` bits is ``ceil(F * b / 8) + meta_bytes_per_row`` bytes
    (the MILP's ``R(b)``); a message to peer ``p`` in key ``k`` is ``rows[k][p]`` rows.

    Args:
        rows: per key (e.g. ``(layer, direction)``), the rows sent to each peer, ``[W]``.
        feature_dims: ``F`` per key (the same keys).
        bit_choices: the widths the assignment may choose.
        meta_bytes_per_row: metadata bytes per row.

    Returns:
        Per peer ``(lo, hi)``: ``lo`` = fewest rows (over keys that send that peer any) at
        the fewest bits, ``hi`` = most rows at the most bits, each at its key's width; ``(0, 0)``
        for a peer no key sends to.
    """
    if not bit_choices:
        raise ValueError("bit_choices must not be empty")
    b_lo, b_hi = min(bit_choices), max(bit_choices)
    lengths = {len(v) for v in rows.values()}
    if len(lengths) > 1:
        raise ValueError(f"every key needs the same number of peers, got {sorted(lengths)}")
    out: list[tuple[float, float]] = []
    for peer in range(lengths.pop() if lengths else 0):
        lo, hi = np.inf, 0.0
        for key, per_peer in rows.items():
            n = int(per_peer[peer])
            if n > 0:
                f = int(feature_dims[key])
                lo = min(lo, n * (np.ceil(f * b_lo / 8) + meta_bytes_per_row))
                hi = max(hi, n * (np.ceil(f * b_hi / 8) + meta_bytes_per_row))
        out.append((float(lo), float(hi)) if hi > 0 else (0.0, 0.0))
    return out


@dataclass(frozen=True)
class LinkFit:
    """One link's (or the pool's) fit and its verdict.

    Attributes:
        cost: the fitted :class:`LinkCost` (meaningful only when ``accepted``).
        r2: share of the per-size medians' variance the line explains (``1.0`` where the
            medians do not vary at all).
        accepted: whether the fit passed the checks of :func:`fit_link`.
        reason: why it was rejected, or how it was refitted (``""``: plain least squares).
        sizes: ``[lo, hi]`` of the probed sizes, bytes.
    """

    cost: LinkCost
    r2: float
    accepted: bool
    reason: str
    sizes: tuple[float, float]


def _median_per_size(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    xs, inv = np.unique(x, return_inverse=True)
    return xs, np.array([np.median(t[inv == i]) for i in range(xs.size)])


def _r2(x: np.ndarray, t: np.ndarray, cost: LinkCost) -> float:
    total = float(np.sum((t - t.mean()) ** 2))
    if total <= 0.0:
        return 1.0
    return 1.0 - float(np.sum((t - (cost.alpha * x + cost.beta)) ** 2)) / total


def fit_link(sizes_bytes: Sequence[float], seconds: Sequence[float], min_r2: float = 0.8) -> LinkFit:
    """Fit one link from its timed messages and check that the fit is physical.

    The rule (module docstring): median per size, least squares on the medians; rejected if
    ``alpha <= 0`` or ``R^2 < min_r2``; refitted with ``beta = 0`` if ``beta < 0``.

    Args:
        sizes_bytes: the size of every timed message, bytes, ``[K * R]`` (repeats allowed).
        seconds: its time, seconds, ``[K * R]``.
        min_r2: the least share of the medians' variance the line must explain, in ``[0, 1]``.

    Returns:
        A :class:`LinkFit`.

    Raises:
        ValueError: on mismatched lengths, non-finite or negative values, or fewer than two
            distinct sizes.
    """
    x = np.asarray(sizes_bytes, dtype=np.float64).reshape(-1)
    t = np.asarray(seconds, dtype=np.float64).reshape(-1)
    _check_samples(x, t)
    if not 0.0 <= min_r2 <= 1.0:
        raise ValueError(f"min_r2 must lie in [0, 1], got {min_r2}")
    xs, med = _median_per_size(x, t)
    span = (float(xs[0]), float(xs[-1]))
    slope, intercept = np.polyfit(xs, med, 1)
    cost, reason = LinkCost(float(slope), float(intercept)), ""
    if cost.alpha <= 0.0:
        return LinkFit(cost, _r2(xs, med, cost), False, f"per-byte cost {cost.alpha:.3g} s/B <= 0", span)
    if cost.beta < 0.0:
        cost, reason = fit_alpha_beta(xs, med), f"latency {intercept:.3g} s < 0: refitted with beta = 0"
    r2 = _r2(xs, med, cost)
    if r2 < min_r2:
        return LinkFit(cost, r2, False, f"the fit explains {r2:.2f} of the variance (< {min_r2})", span)
    return LinkFit(cost, r2, True, reason, span)


def _gap(a: LinkCost, b: LinkCost, span: tuple[float, float]) -> float:
    """Largest difference of the two predictions over ``span`` (at its ends: both are lines),
    relative to ``b``'s time for the largest message of the span."""
    ref = float(b.time(span[1]))
    diff = max(abs(float(a.time(n)) - float(b.time(n))) for n in span)
    return diff / ref if ref > 0 else np.inf


@dataclass
class ResolvedLinks:
    """The costs the assignment uses and how each was obtained.

    Attributes:
        costs: :class:`LinkCost` per ``(sender, peer)`` (every link of the samples).
        fits: each link's own :class:`LinkFit`.
        pooled: the fit of all links' samples together.
        source: per link, ``"own"`` (its own fit), ``"pooled"`` (indistinguishable from, or
            rejected in favour of, the pooled fit), ``"median"`` (rejected, pool rejected
            too: the median accepted link) or ``"nominal"`` (:data:`NOMINAL_COST`).
        notes: one line per link whose fit was rejected (naming it), or one line when every
            link falls back to :data:`NOMINAL_COST`.
    """

    costs: dict[Pair, LinkCost]
    fits: dict[Pair, LinkFit]
    pooled: LinkFit
    source: dict[Pair, str]
    notes: list[str] = field(default_factory=list)


def resolve_links(
    samples: Mapping[Pair, tuple[Sequence[float], Sequence[float]]],
    min_r2: float = 0.8,
    tolerance: float = 0.25,
) -> ResolvedLinks:
    """The cost of every link from its timed messages (rule: module docstring).

    Args:
        samples: per directed link ``(sender, peer)``, ``(sizes_bytes, seconds)`` of every
            timed message (``[K * R]`` each; at least two distinct sizes per link).
        min_r2: :func:`fit_link`'s threshold.
        tolerance: gap to the pooled fit (relative to the pooled time of the link's largest
            probe) below which a link counts as the same link (``>= 0``; ``0`` keeps every
            accepted own fit).

    Returns:
        A :class:`ResolvedLinks`; deterministic in ``samples``.
    """
    if not samples:
        raise ValueError("resolve_links needs the samples of at least one link")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    pairs = sorted((int(s), int(p)) for s, p in samples)
    data = {pair: samples[pair] for pair in pairs}
    fits = {pair: fit_link(*data[pair], min_r2=min_r2) for pair in pairs}
    pooled = fit_link(
        np.concatenate([np.asarray(data[p][0], dtype=np.float64).reshape(-1) for p in pairs]),
        np.concatenate([np.asarray(data[p][1], dtype=np.float64).reshape(-1) for p in pairs]),
        min_r2=min_r2,
    )
    costs: dict[Pair, LinkCost] = {}
    source: dict[Pair, str] = {}
    notes: list[str] = []
    own = [fit.cost for fit in fits.values() if fit.accepted]
    if pooled.accepted:
        fallback, kind, what = pooled.cost, "pooled", "the pooled fit of all links"
    elif 2 * len(own) > len(fits):  # links too different for one line: a rejected link gets the median accepted link
        fallback = LinkCost(float(np.median([c.alpha for c in own])), float(np.median([c.beta for c in own])))
        kind, what = "median", f"the median of the accepted links (the pooled fit is rejected: {pooled.reason})"
    else:
        notes.append(
            f"link profile: the pooled fit ({pooled.reason}) and {len(fits) - len(own)} of {len(fits)} links' fits "
            f"are rejected (the probe saw noise); "
            f"every link uses the nominal cost, as link_costs='uniform'"
        )
        return ResolvedLinks({p: NOMINAL_COST for p in pairs}, fits, pooled, {p: "nominal" for p in pairs}, notes)
    for pair, fit in fits.items():
        if not fit.accepted:
            costs[pair], source[pair] = fallback, kind
            notes.append(f"link {pair[0]}->{pair[1]}: fit rejected ({fit.reason}); using {what}")
        elif pooled.accepted and _gap(fit.cost, pooled.cost, fit.sizes) <= tolerance:
            costs[pair], source[pair] = pooled.cost, "pooled"
        else:
            costs[pair], source[pair] = fit.cost, "own"
    return ResolvedLinks(costs, fits, pooled, source, notes)
