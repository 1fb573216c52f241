"""AdaQP's link cost model (pure): probe sizes, the checked fit, resolving a profile, and what
the bit assignment sees of two noisy profiles of the same links."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from lightning_fullgraph.comm.policies.adaqp.links import (
    NOMINAL_COST,
    fit_alpha_beta,
    fit_link,
    message_range,
    probe_sizes,
    resolve_links,
)
from lightning_fullgraph.comm.policies.adaqp.milp import assign_bits, build_problem


def test_fit_alpha_beta_noiseless() -> None:
    sizes = np.linspace(1e3, 5e7, 40)
    t = 2.5e-9 * sizes + 7e-5
    cost = fit_alpha_beta(sizes.tolist(), t.tolist())
    assert cost.alpha == pytest.approx(2.5e-9, rel=1e-9)
    assert cost.beta == pytest.approx(7e-5, rel=1e-6)
    assert cost.time(1e6) == pytest.approx(2.5e-3 + 7e-5, rel=1e-9)
    assert pickle.loads(pickle.dumps(cost)) == cost


def test_fit_alpha_beta_noisy() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.uniform(1e4, 1e8, 200)
    t = 1e-9 * sizes + 2e-4
    noisy = t * (1 + 0.02 * rng.standard_normal(t.size))
    cost = fit_alpha_beta(sizes, noisy)
    assert cost.alpha == pytest.approx(1e-9, rel=0.02)
    assert abs(cost.beta - 2e-4) < 2e-3  # intercept is noisier than the slope
    assert cost.alpha >= 0 and cost.beta >= 0


def test_fit_alpha_beta_nonnegative() -> None:
    sizes = np.linspace(1e5, 1e6, 20)
    cost = fit_alpha_beta(sizes, 1e-9 * sizes - 5e-5)  # intercept < 0 -> beta pinned at 0
    assert cost.beta == 0.0 and cost.alpha > 0
    cost = fit_alpha_beta(sizes, 5e-3 - 1e-9 * sizes)  # decreasing times -> alpha pinned at 0
    assert cost.alpha == 0.0 and cost.beta > 0
    with pytest.raises(ValueError):
        fit_alpha_beta([1e3, 1e3], [1e-3, 2e-3])
    with pytest.raises(ValueError):
        fit_alpha_beta([1e3, 2e3], [1e-3])


# --------------------------------------------------------------------------- probe sizes


def test_probe_sizes_span_the_links_messages() -> None:
    """AdaQP's ``profile.py`` range: evenly spaced over ``[lo / 2, hi + lo / 2]``, capped.
    Negative control (run): a fixed size list (the former 1 KiB .. 1 MiB) misses both ends."""
    sizes = probe_sizes(4000, 64000, 16, 1 << 24)
    assert sizes[0] == 2000 and sizes[-1] == 66000 and len(sizes) == 16
    assert np.allclose(np.diff(sizes), np.diff(sizes)[0], atol=1)
    capped = probe_sizes(1e6, 1e8, 8, 1 << 24)
    assert capped[0] == 500000 and capped[-1] == 1 << 24 and len(capped) == 8
    assert len(probe_sizes(1, 1, 16, 1 << 24)) >= 2  # a one-byte link still gets two sizes
    with pytest.raises(ValueError, match="lo_bytes"):
        probe_sizes(0, 10, 4, 100)


def test_message_range_covers_every_key_at_the_fewest_and_most_bits() -> None:
    """``lo`` = fewest rows x a row at 2 bits of that key's width; ``hi`` = most rows x a row
    at 8 bits (row bytes ``ceil(F b / 8) + meta``).  Negative control (run): using one key's
    width (or ignoring the backward counts) gives other ends."""
    rows = {(0, "forward"): [0, 100, 0], (1, "forward"): [0, 300, 5], (1, "backward"): [0, 50, 0]}
    dims = {(0, "forward"): 500, (1, "forward"): 64, (1, "backward"): 64}
    out = message_range(rows, dims, (2, 4, 8), 4.0)
    assert out[0] == (0.0, 0.0)
    assert out[1] == (50 * (16 + 4), max(100 * (500 + 4), 300 * (64 + 4)))
    assert out[2] == (5 * (16 + 4), 5 * (64 + 4))


# --------------------------------------------------------------------------- the checked fit


def _line(alpha: float, beta: float, sizes: np.ndarray, repeats: int = 5, noise: float = 0.0,
          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.repeat(sizes, repeats)
    return x, alpha * x + beta + noise * rng.exponential(size=x.size)


def test_fit_link_accepts_a_line_and_takes_the_median_per_size() -> None:
    """One descheduled repeat per size (10x the time) does not move the fit: the median per
    size.  Negative control (run): a plain least-squares fit of all samples doubles beta."""
    sizes = np.linspace(1e5, 2e6, 16)
    x, t = _line(1e-9, 2e-4, sizes)
    t[::5] *= 10  # the first repeat of every size
    fit = fit_link(x, t)
    assert fit.accepted and fit.reason == ""
    assert fit.cost.alpha == pytest.approx(1e-9, rel=1e-6) and fit.cost.beta == pytest.approx(2e-4, rel=1e-6)
    assert fit.sizes == (1e5, 2e6) and fit.r2 == pytest.approx(1.0)


def test_fit_link_rejects_fits_that_are_not_physical() -> None:
    """Times that fall with size (per-byte cost <= 0) and pure jitter (the line explains little)
    are rejected; a negative latency is refitted with beta = 0.  Negative control (run):
    without the checks all three come back accepted with alpha <= 0 / beta < 0."""
    sizes = np.linspace(1e5, 5e5, 16)
    falling = fit_link(*_line(-1e-10, 1e-3, sizes))
    assert not falling.accepted and "per-byte cost" in falling.reason
    rng = np.random.default_rng(1)
    x = np.repeat(sizes, 5)
    jitter = fit_link(x, 5e-4 + 1e-9 * x + rng.exponential(1e-3, x.size))
    assert not jitter.accepted and "explains" in jitter.reason
    negative = fit_link(*_line(1e-9, -5e-5, sizes))
    assert negative.accepted and negative.cost.beta == 0.0 and negative.cost.alpha > 0
    assert "refitted with beta = 0" in negative.reason
    with pytest.raises(ValueError, match="two distinct"):
        fit_link([1e3, 1e3], [1e-3, 2e-3])


# --------------------------------------------------------------------------- resolving a profile


def _profile(pairs: list[tuple[int, int]], alpha: dict, seed: int, jitter: float, lo: float = 2e5,
             hi: float = 4e6) -> dict:
    """Noisy timings of every link: its line plus multiplicative noise plus scheduler jitter."""
    rng = np.random.default_rng(seed)
    out = {}
    for pair in pairs:
        x = np.repeat(probe_sizes(lo, hi, 16, 1 << 24), 5).astype(float)
        t = (alpha.get(pair, 1e-9) * x + 2e-4) * (1 + 0.05 * rng.standard_normal(x.size))
        out[pair] = (x, np.abs(t) + rng.exponential(jitter, x.size))
    return out


PAIRS4 = [(s, p) for s in range(4) for p in range(4) if s != p]


def test_identical_links_share_the_pooled_fit_and_a_slower_one_keeps_its_own() -> None:
    """Links that differ only by noise get one cost (the pooled fit); a link 3x slower keeps
    its own.  Negative control (run): ``tolerance=0`` gives every link its own noisy cost
    (12 distinct costs)."""
    links = resolve_links(_profile(PAIRS4, {(2, 0): 3e-9}, seed=0, jitter=5e-5))
    assert links.pooled.accepted
    assert {links.source[p] for p in PAIRS4 if p != (2, 0)} == {"pooled"}
    assert links.source[(2, 0)] == "own" and links.costs[(2, 0)].alpha == pytest.approx(3e-9, rel=0.15)
    assert len({links.costs[p] for p in PAIRS4}) == 2
    assert not links.notes


def test_a_rejected_link_takes_the_pooled_fit_with_a_note_naming_it() -> None:
    """Negative control (run): without the rejection the link keeps alpha <= 0."""
    samples = _profile(PAIRS4, {}, seed=0, jitter=5e-5)
    x, _ = samples[(1, 3)]
    samples[(1, 3)] = (x, 3e-3 - 1e-10 * x)  # time falls with size
    links = resolve_links(samples)
    assert links.source[(1, 3)] == "pooled" and links.costs[(1, 3)] == links.pooled.cost
    assert len(links.notes) == 1 and links.notes[0].startswith("link 1->3: fit rejected (per-byte cost")


def test_noise_everywhere_falls_back_to_the_nominal_cost() -> None:
    """Messages small against the jitter: no line, every link the nominal (uniform) cost, one
    note.  Negative control (run): the bare NNLS fits come back with 12 different costs."""
    links = resolve_links(_profile(PAIRS4, {}, seed=0, jitter=2e-3, lo=1e3, hi=2e4))
    assert set(links.source.values()) == {"nominal"}
    assert set(links.costs.values()) == {NOMINAL_COST}
    assert len(links.notes) == 1 and "nominal" in links.notes[0]


def _mean_bits(costs: dict) -> float:
    """Mean assigned bits of one fixed 4-rank problem (rows and variances per pair seeded)."""
    rng = np.random.default_rng(123)
    wv = {pair: torch.from_numpy(rng.lognormal(0.0, 1.0, int(rng.integers(500, 3000)))) for pair in PAIRS4}
    problem, _ = build_problem(wv, 100, costs, 4, 256)
    return assign_bits(problem).average_bits


@pytest.mark.parametrize("jitter", [5e-5, 3e-4])
def test_two_noisy_profiles_of_the_same_links_give_the_same_mean_bits(jitter: float) -> None:
    """What the assignment sees: six profiles of the same identical links, at the jitter this
    shared 2-core host shows (5e-5 s: clean lines; 3e-4 s: lines mostly lost for messages of
    0.1-1 MB), give mean bits within 0.3 of each other and of ``link_costs="uniform"``.
    Negative controls (run), at 3e-4 s: per-link fits as before (``fit_alpha_beta`` on each
    link's samples) spread by 0.47 bits; own fits without the checks and without pooling by
    0.64 bits."""
    uniform = _mean_bits({pair: NOMINAL_COST for pair in PAIRS4})
    bits = [
        _mean_bits(resolve_links(_profile(PAIRS4, {}, seed=s, jitter=jitter, lo=1e5, hi=8e5)).costs)
        for s in range(6)
    ]
    assert max(bits) - min(bits) <= 0.3, bits
    assert max(abs(b - uniform) for b in bits) <= 0.3, (bits, uniform)
