r"""A generated graph with ogbn-products' statistics, built in bounded memory.

ogbn-products (Amazon co-purchasing) has 2,449,029 nodes, 61,859,140 undirected edges
(123,718,280 directed), 100 node features, 47 classes, a heavy-tailed degree distribution
(mean 50.5, median about 26, maximum about 17,000), edge homophily about 0.81 and a
196,615 / 39,323 / 2,213,091 train / validation / test split.  It cannot be downloaded
here, so :func:`products_like_graph` generates a graph with those statistics, reachable by
name (``"products-like"``) from :func:`~lightning_fullgraph.data.datasets.load_dataset`,
:class:`~lightning_fullgraph.FullGraphDataModule` and ``lightning-fullgraph partition``.

Model (a degree-corrected stochastic block model, Chung-Lu inside and across classes):

.. math::
    y_v \sim \mathrm{Cat}(\pi), \quad \pi_k \propto (k + 1)^{-s}, \qquad
    w_v = e^{\sigma z_v + t_v / \alpha}, \; z_v \sim \mathcal{N}(0, 1), \; t_v \sim \mathrm{Exp}(1)

Every undirected edge draws its first end ``u`` with probability :math:`\propto w_u`; with
probability ``homophily`` its second end is drawn :math:`\propto w` among the nodes of
class :math:`y_u`, otherwise :math:`\propto w` among the nodes of the other classes.  A
node's expected degree is therefore proportional to its propensity :math:`w_v`: a lognormal
body times a Pareto factor (``P(w > x) ~ x^-alpha``).

Locality (version 2).  Co-purchases are local: a product is bought with a few related ones,
so METIS finds parts with a small cut.  Without structure below the 47 classes a METIS 4-way
partition leaves each rank receiving ~2.3x the rows it owns, which no real co-purchase graph
does.  So every node also has a place :math:`\rho_v \in [0, 1)` (its rank inside its class,
hidden from the node ids), and a fraction ``locality`` of the edges keeps the chosen second
class but draws the second end only among that class's nodes whose place lies in the same
*block* as :math:`\rho_u`: blocks of width :math:`b_0 4^{l} / N` of every class (nested,
so the same blocks of all classes form one "theme"), at a level
:math:`l \sim \mathrm{Geometric}(1 - \text{level\_decay})`, widened to hold 4x the first
end's expected degree so hubs keep distinct partners.  The rest (``1 - locality``) are drawn
over the whole class as above.  Homophily is untouched by construction; the degree tail
is somewhat lighter (a hub's partners are drawn from its own block).  The defaults
(``locality=0.99``, ``block_nodes=64``, ``level_decay=0.3``) give a METIS 4-way edge cut of
~5 % and a total halo of ~0.7 N at 10^6 nodes; real ogbn-products' figures could not be
checked here (no download), so this is a modelling choice, and ``locality=0`` gives the
structure-less version-1 graph for a pessimistic bound.  :math:`\sigma = 1`, :math:`\alpha =
2.8` give, at 2.45 M nodes, a median degree about half the mean (products: 26 of 50.5) and a
maximum around ten thousand (products: about 17,000); the measured statistics are in
``benchmarks/results/scale.md``.  Self-loops are dropped, duplicate pairs are drawn again
(a few rounds) until exactly ``num_edges`` distinct undirected pairs exist, and every pair
is stored in both directions, sorted by (source, destination) (coalesced).  Features are
``centroid[y] + N(0, I)`` with class centroids drawn from :math:`\mathcal{N}(0, 0.1^2 I)`,
so the features alone are weakly informative and neighbourhood aggregation matters.  The
masks are a seeded random split with products' proportions (8.03 % / 1.61 % / 90.37 %).

Memory bound.  Nothing dense and nothing of size ``O(E)`` in Python objects is built; edge
candidates are drawn in chunks of :data:`EDGE_CHUNK` pairs into one preallocated ``int64``
key buffer (``u * N + v``, ``u < v``) that is sorted and de-duplicated **in place**.  With
``M`` undirected edges and ``N`` nodes of ``F`` features the peak is about

.. math::
    \max\bigl(8 \cdot 1.03 M,\; 16 M + 32 M\bigr) + 4 N F + O(N) + O(\text{chunk})

bytes (keys; then both directions plus ``edge_index``; then ``x``), i.e. at most about 1.5x
the finished graph's own size (``edge_index`` + ``x`` + ``y`` + masks) plus ~100 MiB of
fixed-size chunk temporaries (the ``O(N)`` term includes the sampler's ``16 N``-byte guide
table).  Measured (version 2): 1.2x at products' size (2.78 GiB graph, 3.3 GiB peak above
the imports, 47 s on one core); the constant dominates at 10^5 nodes;
``tests/unit/test_products_like.py`` checks the bound.

Determinism: only a private :class:`torch.Generator` seeded with ``seed`` is used, chunk
sizes are constants, and every sort is of distinct keys, so the graph is identical for a
given seed, size and :data:`GENERATOR_VERSION` on any machine with the same torch version.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_fullgraph.data.datasets.registry import GENERATED_NAMES, is_generated_name

__all__ = [
    "GENERATOR_VERSION",
    "PRODUCTS_STATS",
    "generated_fingerprint",
    "products_like_graph",
]

#: Bumped whenever the generator's output for given arguments changes (it is part of the
#: fingerprint that identifies a cached partition of a generated graph).
GENERATOR_VERSION = 2

#: ogbn-products' statistics (the defaults of :func:`products_like_graph`).
PRODUCTS_STATS: dict[str, Any] = {
    "num_nodes": 2_449_029,
    "num_edges": 61_859_140,  # undirected; 123,718,280 directed
    "num_features": 100,
    "num_classes": 47,
    "homophily": 0.81,
    "split": (196_615, 39_323, 2_213_091),
}

#: Candidate pairs drawn per step (bounds the temporary memory: ~100 bytes per pair, ~100 MiB).
EDGE_CHUNK = 1 << 20
_FEATURE_CHUNK = 1 << 16
_CENTROID_STD = 0.1
_MAX_ROUNDS = 16
#: A local block holds at least this many times its first end's expected degree in nodes.
_BLOCK_CAPACITY = 4.0
_LOCAL_SLICE = 1 << 17
#: Equal-weight buckets per node of the sampler's guide table (``8 B`` each), and the prefix
#: sums its search reads from a bucket's start before falling back to a binary search.
_GUIDE_BUCKETS_PER_NODE = 2
_GUIDE_PROBES = 2


def _check(name: str, value: Any, low: float, high: float = math.inf, integer: bool = False) -> Any:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
    ):
        raise ValueError(f"{name} must be {'an int' if integer else 'a number'}, got {value!r}")
    if not (low <= value <= high) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _resolve(
    num_nodes: int,
    num_edges: int | None,
    avg_degree: float | None,
    split: tuple[int, int, int] | None,
) -> tuple[int, int, tuple[int, int, int]]:
    full = PRODUCTS_STATS
    num_nodes = _check("num_nodes", num_nodes, 2, 2**31 - 1, integer=True)
    if num_edges is not None and avg_degree is not None:
        raise ValueError("give num_edges or avg_degree, not both")
    if num_edges is None:
        degree = 2 * full["num_edges"] / full["num_nodes"] if avg_degree is None else avg_degree
        degree = _check("avg_degree", degree, 0.0)
        num_edges = round(num_nodes * degree / 2)
    num_edges = _check("num_edges", num_edges, 0, num_nodes * (num_nodes - 1) // 2, integer=True)
    if split is None:
        fractions = [s / full["num_nodes"] for s in full["split"]]
        n_train, n_val = round(num_nodes * fractions[0]), round(num_nodes * fractions[1])
        split = (n_train, n_val, num_nodes - n_train - n_val)
    split = tuple(int(_check("split", s, 0, num_nodes, integer=True)) for s in split)  # type: ignore[assignment]
    if len(split) != 3 or sum(split) > num_nodes:
        raise ValueError(f"split must be 3 sizes (train, val, test) summing to <= num_nodes, got {split}")
    return num_nodes, num_edges, split  # type: ignore[return-value]


class _Sampler:
    """What :func:`_draw_pairs` needs, built once per graph (all indexed by class-sorted
    position ``a`` or by class ``k``)."""

    def __init__(
        self,
        num_nodes: int,
        num_edges: int,
        cum_w: Tensor,
        order: Tensor,
        pos_class: Tensor,
        class_lo: Tensor,
        class_w: Tensor,
        class_start: Tensor,
        class_count: Tensor,
        homophily: float,
        locality: float,
        block_nodes: int,
        level_decay: float,
    ) -> None:
        self.num_nodes, self.cum_w, self.order, self.pos_class = num_nodes, cum_w, order, pos_class
        self.class_lo, self.class_w = class_lo, class_w
        self.class_start, self.class_count = class_start, class_count
        self.homophily, self.locality = homophily, locality
        self.block_nodes, self.level_decay = block_nodes, level_decay
        self.total = float(cum_w[-1])
        # an edge end's expected degree is 2 M w / W; a block must hold _BLOCK_CAPACITY times it
        self.degree_per_weight = 2.0 * num_edges / self.total
        # guide table of search(): the answer at the left edge of each of B equal-weight buckets
        buckets = _GUIDE_BUCKETS_PER_NODE * num_nodes
        self.step = self.total / buckets
        self.guide = torch.searchsorted(cum_w, torch.arange(buckets, dtype=torch.float64) * self.step, right=True)

    def search(self, t: Tensor) -> Tensor:
        """``torch.searchsorted(cum_w, t, right=True)``, bit for bit, in fewer random reads.

        A binary search over the ``N`` prefix sums reads ``log2 N`` places at random, most
        of them cache misses once ``N`` outgrows the cache (measured: 110 ns per query at
        10^5 nodes, 260 ns at 2.45 M).  Here ``t`` starts from the answer at the left edge
        of its equal-weight bucket (``guide``) and counts the prefix sums ``<= t`` among the
        next :data:`_GUIDE_PROBES`: two reads close together.  The start is checked
        (``cum_w[lo - 1] <= t``, so no answer lies below it, whatever the rounding of
        ``t / step``) and so is the end (a prefix sum above ``t`` among the probes); the
        few queries failing either go to ``torch.searchsorted``.

        Shapes:
            ``t [Q]`` float64 -> ``[Q]`` int64 in ``[0, N]``.
        """
        cum_w, n = self.cum_w, self.num_nodes
        j = torch.div(t, self.step).floor_().clamp_(0, self.guide.numel() - 1).long()
        lo = self.guide[j]
        del j
        ok = cum_w[(lo - 1).clamp_(min=0)] <= t
        ok |= lo == 0
        found = torch.zeros_like(lo)
        for i in range(_GUIDE_PROBES):
            p = lo + i
            le = cum_w[p.clamp(max=n - 1)] <= t
            le &= p < n
            found += le
        ok &= found < _GUIDE_PROBES  # cum_w is sorted: the probes <= t are a prefix of them
        found += lo
        bad = (~ok).nonzero().view(-1)
        if bad.numel():
            found[bad] = torch.searchsorted(cum_w, t[bad], right=True)
        return found


def _draw_pairs(count: int, s: _Sampler, gen: torch.Generator, out: np.ndarray) -> int:
    """Draws ``count`` candidate pairs into ``out`` as keys ``u * N + v`` (``u < v``); returns
    how many were written (self-loops are dropped)."""
    num_nodes, total = s.num_nodes, s.total
    written = 0
    for lo in range(0, count, EDGE_CHUNK):
        n = min(EDGE_CHUNK, count - lo)
        # first end proportional to w (a position in the class-sorted order)
        a = s.search(torch.rand(n, generator=gen, dtype=torch.float64) * total)
        a.clamp_(max=num_nodes - 1)
        k = s.pos_class[a]
        lo_w, cw = s.class_lo[k], s.class_w[k]
        r = torch.rand(n, generator=gen, dtype=torch.float64)
        intra = torch.rand(n, generator=gen) < s.homophily
        intra |= (total - cw) <= 0  # a single non-empty class: nowhere else to go
        # intra: a point of the class's weight range; inter: of the rest (skip the class's range)
        t = torch.where(intra, lo_w + r * cw, r * (total - cw))
        t = torch.where(intra | (t < lo_w), t, t + cw)
        b = s.search(t).clamp_(max=num_nodes - 1)
        del lo_w, cw, r, intra, t
        if s.locality > 0:
            b = _localise(a, k, b, s, gen)
        del k
        u, v = s.order[a], s.order[b]
        keep = u != v
        u, v = u[keep], v[keep]
        keys = torch.minimum(u, v) * num_nodes + torch.maximum(u, v)
        out[written : written + keys.numel()] = keys.numpy()
        written += keys.numel()
    return written


def _localise(a: Tensor, k: Tensor, b: Tensor, s: _Sampler, gen: torch.Generator) -> Tensor:
    """Moves the second end of a ``locality`` fraction of the pairs into the first end's block.

    ``b`` was drawn over its whole class ``kt``; a local pair keeps ``kt`` (so homophily is
    unchanged) but redraws the end, proportionally to ``w``, inside the block of ``kt``'s
    class-sorted range that sits at the same relative position as ``a`` in its own class.
    The block's width (a fraction of every class) is ``block_nodes * 4^l / N`` at a level
    ``l ~ Geometric(1 - level_decay)``, widened to hold ``_BLOCK_CAPACITY`` times the first
    end's expected degree (so hubs do not run out of distinct partners), at most the class.
    """
    n = a.numel()
    local = torch.rand(n, generator=gen) < s.locality
    u_level = torch.rand(n, generator=gen, dtype=torch.float64)
    u_pick = torch.rand(n, generator=gen, dtype=torch.float64)
    # the arithmetic below holds ~16 temporaries per pair: slices keep them to a few MiB
    for lo in range(0, n, _LOCAL_SLICE):
        sl = slice(lo, min(n, lo + _LOCAL_SLICE))
        b[sl] = torch.where(local[sl], _block_draw(a[sl], k[sl], b[sl], u_level[sl], u_pick[sl], s), b[sl])
    return b


def _block_draw(a: Tensor, k: Tensor, b: Tensor, u_level: Tensor, u_pick: Tensor, s: _Sampler) -> Tensor:
    """The second end redrawn inside the first end's block (see :func:`_localise`)."""
    level = torch.floor(torch.log(u_level.clamp(min=1e-300)) / math.log(s.level_decay))
    kt = s.pos_class[b]
    n_t = s.class_count[kt].double()
    w_a = s.cum_w[a] - torch.where(a > 0, s.cum_w[(a - 1).clamp_(min=0)], 0.0)
    need = _BLOCK_CAPACITY * s.degree_per_weight * w_a / n_t  # relative width for the degree
    del w_a
    width = (s.block_nodes / s.num_nodes) * torch.pow(4.0, level.clamp_(max=60.0))
    width = torch.maximum(width, need).clamp_(max=1.0)
    del need, level
    start_k = s.class_start[k]
    rel = ((a - start_k).double() + 0.5) / s.class_count[k].double()  # a's place in its class
    j = torch.floor(rel / width)
    del rel, start_k
    start_t = s.class_start[kt]
    lo = start_t + torch.floor(j * width * n_t).long()
    hi = start_t + torch.floor(torch.clamp((j + 1) * width, max=1.0) * n_t).long()
    del j, width, n_t, start_t, kt
    hi = torch.maximum(hi, lo + 1)
    w_lo = torch.where(lo > 0, s.cum_w[(lo - 1).clamp_(min=0)], 0.0)
    t = w_lo + u_pick * (s.cum_w[hi - 1] - w_lo)
    del w_lo
    b_local = s.search(t)
    return torch.minimum(torch.maximum(b_local, lo), hi - 1)


def _dedupe_sorted(buf: np.ndarray, n: int) -> int:
    """Removes repeats from the sorted ``buf[:n]`` in place (chunked); returns the new length."""
    if n == 0:
        return 0
    w = 0
    prev = None
    for lo in range(0, n, EDGE_CHUNK):
        hi = min(lo + EDGE_CHUNK, n)
        chunk = buf[lo:hi]
        first = np.empty(hi - lo, dtype=bool)
        first[0] = prev is None or chunk[0] != prev
        np.not_equal(chunk[1:], chunk[:-1], out=first[1:])
        prev = chunk[-1]
        kept = chunk[first]  # a copy: the write below may overlap the chunk
        buf[w : w + kept.size] = kept
        w += kept.size
    return w


def _unique_pairs(num_edges: int, sampler: _Sampler, gen: torch.Generator) -> np.ndarray:
    """Exactly ``num_edges`` distinct sorted keys (fewer only if the draws keep colliding)."""
    slack = max(1024, num_edges // 32)
    buf = np.empty(num_edges + slack, dtype=np.int64)
    have = 0
    locality = sampler.locality
    for round_ in range(_MAX_ROUNDS):
        missing = num_edges - have
        if missing <= 0:
            break
        # the few pairs still missing after three rounds keep colliding inside small blocks
        # (tiny graphs, hubs): halve their locality each round so they find distinct partners
        sampler.locality = locality * 0.5 ** max(0, round_ - 2)
        # draw what is missing plus a margin for self-loops and repeats, within the buffer
        draw = min(buf.size - have, missing + missing // 16 + 64)
        got = _draw_pairs(draw, sampler, gen, buf[have:])
        if have == 0:
            buf[:got].sort()
            have = _dedupe_sorted(buf, got)
        else:
            new = buf[have : have + got]
            new.sort()
            m = _dedupe_sorted(new, got)
            new = new[:m]
            pos = np.searchsorted(buf[:have], new)
            pos_c = np.minimum(pos, have - 1)
            fresh = new[buf[pos_c] != new]
            del pos, pos_c
            buf[have : have + fresh.size] = fresh
            merged = buf[: have + fresh.size]
            merged.sort()  # a sorted run plus a short tail
            have += fresh.size
        if have > num_edges:
            # drop the surplus at random positions (keeps the sample unbiased)
            surplus = have - num_edges
            drop = torch.randint(have, (surplus * 2 + 16,), generator=gen).numpy()
            drop = np.unique(drop)[:surplus]
            while drop.size < surplus:  # pragma: no cover - vanishingly rare
                more = torch.randint(have, (surplus,), generator=gen).numpy()
                drop = np.unique(np.concatenate([drop, more]))[:surplus]
            buf[drop] = -1
            kept = 0
            for lo in range(0, have, EDGE_CHUNK):
                chunk = buf[lo : min(lo + EDGE_CHUNK, have)]
                sel = chunk[chunk >= 0]
                buf[kept : kept + sel.size] = sel
                kept += sel.size
            have = kept
    sampler.locality = locality
    return buf[:have]


def products_like_graph(
    num_nodes: int = PRODUCTS_STATS["num_nodes"],
    num_edges: int | None = None,
    avg_degree: float | None = None,
    num_features: int = PRODUCTS_STATS["num_features"],
    num_classes: int = PRODUCTS_STATS["num_classes"],
    homophily: float = PRODUCTS_STATS["homophily"],
    degree_sigma: float = 1.0,
    tail_alpha: float = 2.8,
    class_skew: float = 1.0,
    locality: float = 0.99,
    block_nodes: int = 64,
    level_decay: float = 0.3,
    split: tuple[int, int, int] | list[int] | None = None,
    seed: int = 0,
) -> Data:
    """Generates a graph with ogbn-products' statistics (see the module docstring).

    With the defaults the graph has products' node and edge counts, feature width, class
    count, homophily and split sizes.  ``num_nodes`` alone scales it down (or up) at the
    same mean degree (50.52) and split proportions, which is what a scaling sweep needs.

    Args:
        num_nodes: Nodes ``N`` (default 2,449,029).
        num_edges: Undirected edges ``M`` (each stored in both directions); default
            ``round(N * avg_degree / 2)``.
        avg_degree: Mean degree, if ``num_edges`` is not given (default products' 50.52).
        num_features: Feature width ``F`` (default 100).
        num_classes: Classes ``C`` (default 47).
        homophily: Target edge homophily, the fraction of edges inside a class (default 0.81).
        degree_sigma: Standard deviation of the lognormal body of the propensity (default 1).
        tail_alpha: Exponent of the Pareto factor of the propensity; the degree tail falls
            as ``x^-tail_alpha`` (heavier when smaller; default 2.8).
        class_skew: Class sizes are ``~ (k + 1)^-class_skew`` (0 = uniform; default 1).
        locality: Fraction of the edges drawn inside their first end's nested block (see
            the module docstring); 0 gives the version-1 graph with no structure below the
            classes (default 0.99).
        block_nodes: Nodes (over all classes) in a level-0 block (default 64).
        level_decay: ``P(level = l) = (1 - level_decay) level_decay^l``; smaller keeps more
            edges in small blocks (default 0.3).
        split: ``(train, val, test)`` sizes; default products' proportions of ``N``.
        seed: Seed of the private random generator.

    Returns:
        ``Data`` with ``x`` ``[N, F]`` float32, ``y`` ``[N]`` int64, ``edge_index``
        ``[2, 2M]`` int64 (coalesced, symmetric, no self-loops or duplicates), boolean
        ``train_mask`` / ``val_mask`` / ``test_mask`` and ``num_nodes``.

    Raises:
        ValueError: If an argument is out of range.
    """
    num_nodes, num_edges, split = _resolve(num_nodes, num_edges, avg_degree, tuple(split) if split else None)
    num_features = _check("num_features", num_features, 1, integer=True)
    num_classes = _check("num_classes", num_classes, 1, num_nodes, integer=True)
    homophily = float(_check("homophily", homophily, 0.0, 1.0))
    degree_sigma = float(_check("degree_sigma", degree_sigma, 0.0, 4.0))
    tail_alpha = float(_check("tail_alpha", tail_alpha, 1.0, math.inf))
    class_skew = float(_check("class_skew", class_skew, 0.0, 4.0))
    locality = float(_check("locality", locality, 0.0, 1.0))
    block_nodes = _check("block_nodes", block_nodes, 1, integer=True)
    level_decay = float(_check("level_decay", level_decay, 1e-6, 1.0 - 1e-6))
    seed = _check("seed", seed, -(2**63), 2**63 - 1, integer=True)
    n = num_nodes
    gen = torch.Generator().manual_seed(seed)

    # classes and propensities
    probs = torch.arange(1, num_classes + 1, dtype=torch.float64).pow(-class_skew)
    y = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=gen)
    w = degree_sigma * torch.randn(n, generator=gen, dtype=torch.float64)
    w += torch.empty(n, dtype=torch.float64).exponential_(generator=gen) / tail_alpha
    w.exp_()
    # nodes grouped by class, in a random order inside each class: a node's place in its class
    # (its block) is not visible in its id, so a partitioner cannot read the structure off ids
    shuffle = torch.randperm(n, generator=gen)
    order = shuffle[torch.argsort(y[shuffle], stable=True)]
    del shuffle
    w_sorted = w[order]
    del w
    cum_w = torch.cumsum(w_sorted, 0)
    counts = torch.bincount(y, minlength=num_classes)
    ends = torch.cumsum(counts, 0)
    class_w = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, y[order], w_sorted)
    class_lo = torch.cumsum(class_w, 0) - class_w
    pos_class = torch.repeat_interleave(torch.arange(num_classes), counts)  # class of each sorted position
    sampler = _Sampler(
        n, num_edges, cum_w, order, pos_class, class_lo, class_w,
        class_start=ends - counts, class_count=counts.clamp(min=1),
        homophily=homophily, locality=locality, block_nodes=block_nodes, level_decay=level_decay,
    )  # fmt: skip
    del w_sorted, ends

    keys = _unique_pairs(num_edges, sampler, gen)
    del cum_w, pos_class, order, sampler
    m = keys.size

    # both directions, sorted by (source, destination): keys of (v, u) appended, one sort
    both = np.empty(2 * m, dtype=np.int64)
    for lo in range(0, m, EDGE_CHUNK):
        hi = min(lo + EDGE_CHUNK, m)
        chunk = keys[lo:hi]
        both[lo:hi] = chunk
        u, v = np.divmod(chunk, n)
        both[m + lo : m + hi] = v * n + u
    del keys
    both.sort()
    edge_index = torch.empty(2, 2 * m, dtype=torch.int64)
    ei = edge_index.numpy()
    for lo in range(0, 2 * m, EDGE_CHUNK):
        hi = min(lo + EDGE_CHUNK, 2 * m)
        np.divmod(both[lo:hi], n, out=(ei[0, lo:hi], ei[1, lo:hi]))
    del both

    centroids = torch.randn(num_classes, num_features, generator=gen) * _CENTROID_STD
    x = torch.randn(n, num_features, generator=gen)
    for lo in range(0, n, _FEATURE_CHUNK):
        hi = min(lo + _FEATURE_CHUNK, n)
        x[lo:hi] += centroids[y[lo:hi]]

    perm = torch.randperm(n, generator=gen)
    masks = []
    start = 0
    for size in split:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[perm[start : start + size]] = True
        masks.append(mask)
        start += size
    del perm
    return Data(
        x=x,
        y=y,
        edge_index=edge_index,
        train_mask=masks[0],
        val_mask=masks[1],
        test_mask=masks[2],
        num_nodes=n,
    )


_SIGNATURE_OF = products_like_graph  # the fingerprint reads this function's defaults


def generated_fingerprint(name: str, **kwargs: Any) -> str:
    """A fingerprint of the generated graph ``name(**kwargs)`` computed without building it.

    sha256 over the canonical name, the keyword arguments (defaults filled in, so
    ``products-like`` and ``products-like(num_nodes=2449029)`` agree) and
    :data:`GENERATOR_VERSION`.  The partition cache keys generated graphs by it, so a cache
    hit never generates the graph.  (The torch version is not part of it: torch's CPU
    generator has produced the same streams across releases.)

    Raises:
        ValueError: for an unknown name; TypeError for an unknown keyword.
    """
    if not is_generated_name(name):
        raise ValueError(f"{name!r} is not a generated graph; known: {GENERATED_NAMES}")
    import inspect

    params = inspect.signature(_SIGNATURE_OF).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(f"products_like_graph() got unexpected keyword argument(s) {unknown}")
    resolved = {k: p.default for k, p in params.items()}
    resolved.update(kwargs)
    resolved["split"] = list(resolved["split"]) if resolved["split"] is not None else None
    blob = json.dumps(
        {"name": "products-like", "version": GENERATOR_VERSION, "kwargs": resolved}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()
