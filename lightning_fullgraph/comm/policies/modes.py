"""The one mode table: each mode's policy class, settings, overlap default and strategy names.

Everything that lists the modes reads this table: the strategy (``mode=`` and its settings,
the overlap default), Lightning's strategy registry (``fullgraph_<mode>`` and the aliases), the
CLI (which settings a mode takes) and the docs.  Adding a mode is one policy module plus one
row.  (The table lives apart from :mod:`~lightning_fullgraph.comm.policies.base` because it
names the policy classes, which import the base.)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from lightning_fullgraph.comm.policies.adaqp.policy import AdaQPPolicy
from lightning_fullgraph.comm.policies.base import CompressionPolicy
from lightning_fullgraph.comm.policies.exact import ExactPolicy
from lightning_fullgraph.comm.policies.sylvie.policy import SylviePolicy

__all__ = [
    "MODES",
    "MODE_TABLE",
    "POLICIES",
    "Mode",
    "make_policy",
    "resolve_policy",
    "mode_of",
    "overlap_by_default",
    "policy_settings",
    "strategy_names",
]


@dataclass(frozen=True)
class Mode:
    """One row of the mode table.

    Attributes:
        name: The mode (``FullGraphStrategy(mode=...)``); also the policy's ``name``.
        policy: The policy class; its constructor's arguments are the settings the mode takes.
        description: One line for Lightning's strategy registry (``fullgraph_<name>``).
        overlap_by_default: Whether central/marginal overlap may run unless
            ``FullGraphStrategy(overlap=...)`` says: it then runs where the central share of
            the aggregation is large enough (decided at setup, :mod:`lightning_fullgraph.nn.overlap`).
        aliases: Further strategy names for this mode, ``(name, description)`` each.
    """

    name: str
    policy: type[CompressionPolicy]
    description: str
    overlap_by_default: bool = False
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def settings(self) -> frozenset[str]:
        """The settings the mode takes (its policy constructor's arguments)."""
        return frozenset(inspect.signature(self.policy.__init__).parameters) - {"self"}


#: The modes, in the order they are listed.
MODE_TABLE: dict[str, Mode] = {
    row.name: row
    for row in (
        Mode("exact", ExactPolicy, "exact fp32 halo exchange"),
        Mode(
            "adaqp", AdaQPPolicy, "AdaQP: adaptive stochastic 2/4/8-bit messages", overlap_by_default=True,
            aliases=(("fullgraph_quant", "quantized halo messages (AdaQP unless mode= says otherwise)"),),
        ),
        Mode("sylvie", SylviePolicy, "Sylvie: one-bit messages, bounded-staleness pipeline"),
    )
}

#: The mode names.
MODES: tuple[str, ...] = tuple(MODE_TABLE)
#: Mode name -> policy class (read from :data:`MODE_TABLE`).
POLICIES: dict[str, type[CompressionPolicy]] = {name: row.policy for name, row in MODE_TABLE.items()}


def policy_settings(mode: str) -> frozenset[str]:
    """The settings ``mode``'s policy takes (its constructor's arguments)."""
    return MODE_TABLE[mode].settings


def mode_of(policy: CompressionPolicy) -> Mode | None:
    """The row of the most derived table class ``policy`` is an instance of (a subclass of a
    mode's policy inherits its row), or ``None`` for a policy outside the table."""
    for cls in type(policy).__mro__:
        for row in MODE_TABLE.values():
            if row.policy is cls:
                return row
    return None


def overlap_by_default(policy: CompressionPolicy) -> bool:
    """Whether central/marginal overlap may run for ``policy`` unless the strategy says (its
    mode's row; off for a policy outside the table); where the central share allows is
    :func:`lightning_fullgraph.nn.overlap.decide_overlap`'s decision."""
    row = mode_of(policy)
    return row.overlap_by_default if row is not None else False


def strategy_names() -> dict[str, tuple[str, str]]:
    """Lightning strategy name -> ``(description, mode)``: the aliases, then
    ``fullgraph_<mode>`` for every mode."""
    names = {alias: (text, row.name) for row in MODE_TABLE.values() for alias, text in row.aliases}
    names.update({f"fullgraph_{name}": (row.description, name) for name, row in MODE_TABLE.items()})
    return names


def make_policy(mode: str, **settings: Any) -> CompressionPolicy:
    """The policy of ``mode`` built from the settings that apply to it (``None`` values are
    left at the policy's default)."""
    if mode not in POLICIES:
        raise ValueError(f"mode={mode!r} is not a mode; choose one of {tuple(POLICIES)}")
    cls = POLICIES[mode]
    accepted = policy_settings(mode)
    given = {k: v for k, v in settings.items() if v is not None}
    extra = sorted(set(given) - accepted)
    if extra == ["bits"] and mode == "exact":
        raise ValueError("mode='exact' sends fp32; drop `bits` or use mode='adaqp'")
    if extra:
        raise ValueError(f"mode={mode!r} does not take {extra}; it takes {sorted(accepted) or 'no settings'}")
    return cls(**given)



def resolve_policy(mode: str | None, policy: CompressionPolicy | None, **settings: Any) -> CompressionPolicy:
    """The strategy's policy: ``policy`` when given (then ``mode`` and every setting must be
    unset or agree), else :func:`make_policy` of ``mode`` (default ``"exact"``) with the
    settings that apply to it (``None`` values left at the policy's default)."""
    if policy is not None:
        given = sorted(k for k, v in settings.items() if v is not None)
        if given or (mode is not None and mode != policy.name):
            raise ValueError(
                f"FullGraphStrategy(policy={policy!r}) carries its own settings; drop "
                f"{given or ['mode=' + repr(mode)]} or configure them on the policy"
            )
        return policy
    mode = "exact" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"FullGraphStrategy(mode={mode!r}) is not a mode; choose one of {MODES}")
    return make_policy(mode, **settings)
