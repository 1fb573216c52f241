"""Names of the benchmarked configurations ("modes") and the ``FullGraphStrategy`` settings
each one runs, shared by the orchestrator (``run.py``), the worker and the report.

A *mode* is one of the strategy's modes or a diagnostic variant of one::

    exact, adaqp, sylvie              FullGraphStrategy(mode=...)
    adaqp-nooverlap                   adaqp with overlap=False
    adaqp-overlap                     adaqp with overlap=True (the split forced on)
    exact-overlap                     exact with the central/marginal overlap on
    exact-inputs, adaqp-inputs,       the mode with project_messages=False: every layer
    sylvie-inputs                     sends its input (the seeds' message, and this
                                      package's before projected messages): before/after
                                      in one run

Every mode ``M`` has a *bound* ``M-bound``: the same settings plus ``compute_only=True``, i.e.
mode ``M``'s own compute path (overlap split, quantize/dequantize, Sylvie's pipeline
bookkeeping) with every halo collective skipped (halo rows are zeros, results are wrong).
It is the time ``M`` would take if its halo transfers were free, the limit ``M`` can approach;
``M`` is reported against ``M-bound``, never against another mode's bound.

``compute-only`` (the name of ``exact-bound`` in earlier results and on earlier command
lines) and ``compute-only-overlap`` (``exact-overlap-bound``) are accepted as aliases.
"""

from __future__ import annotations

from typing import Any

BOUND_SUFFIX = "-bound"
# variant -> FullGraphStrategy keyword arguments (without compute_only)
VARIANT_SETTINGS: dict[str, dict[str, Any]] = {
    "exact": {"mode": "exact"},
    "exact-overlap": {"mode": "exact", "overlap": True},
    "adaqp": {"mode": "adaqp"},
    "adaqp-nooverlap": {"mode": "adaqp", "overlap": False},
    "adaqp-overlap": {"mode": "adaqp", "overlap": True},
    "sylvie": {"mode": "sylvie"},
    # AdaQP's assignment inside Sylvie's pipeline (PipeQS-style combination)
    "sylvie-adaptive": {"mode": "sylvie", "bits": "adaptive"},
    # every layer sends its input, not a narrowing layer's projection (HaloContext.sends_projection)
    "exact-inputs": {"mode": "exact", "project_messages": False},
    "adaqp-inputs": {"mode": "adaqp", "project_messages": False},
    "sylvie-inputs": {"mode": "sylvie", "project_messages": False},
}
BASE_MODES = ("exact", "adaqp", "sylvie")
ALIASES = {"compute-only": "exact-bound", "compute-only-overlap": "exact-overlap-bound"}
# what `--modes` runs by default: every mode and its own bound
DEFAULT_MODES = ("exact", "exact-bound", "adaqp", "adaqp-bound", "sylvie", "sylvie-bound")
_ORDER = tuple(VARIANT_SETTINGS)


def canonical(name: str) -> str:
    """``compute-only`` -> ``exact-bound`` (old name); every other name as given."""
    return ALIASES.get(name, name)


def is_bound(name: str) -> bool:
    return canonical(name).endswith(BOUND_SUFFIX)


def unbound(name: str) -> str:
    """The mode a bound belongs to (``adaqp-bound`` -> ``adaqp``); a mode itself otherwise."""
    name = canonical(name)
    return name[: -len(BOUND_SUFFIX)] if name.endswith(BOUND_SUFFIX) else name


def bound_of(name: str) -> str:
    """The bound of a mode (``adaqp`` -> ``adaqp-bound``); a bound is its own bound."""
    return unbound(name) + BOUND_SUFFIX


def is_known(name: str) -> bool:
    return unbound(name) in VARIANT_SETTINGS


def base_mode(name: str) -> str:
    """The strategy mode a name runs (``adaqp-nooverlap-bound`` -> ``adaqp``)."""
    return VARIANT_SETTINGS[unbound(name)]["mode"]


def strategy_settings(name: str) -> dict[str, Any]:
    """``FullGraphStrategy`` keyword arguments of a mode or bound name.

    >>> strategy_settings("adaqp-bound")
    {'mode': 'adaqp', 'compute_only': True}
    """
    if not is_known(name):
        raise ValueError(f"unknown benchmark mode {name!r}; choose from {all_names()}")
    settings = dict(VARIANT_SETTINGS[unbound(name)])
    if is_bound(name):
        settings["compute_only"] = True
    return settings


def all_names() -> tuple[str, ...]:
    return tuple(n for v in VARIANT_SETTINGS for n in (v, v + BOUND_SUFFIX))


def sort_key(name: str) -> tuple[int, int, str]:
    """exact, exact-bound, exact-overlap, ..., adaqp, adaqp-bound, ..., sylvie, sylvie-bound."""
    base = unbound(name)
    return (_ORDER.index(base) if base in _ORDER else len(_ORDER), int(is_bound(name)), name)
