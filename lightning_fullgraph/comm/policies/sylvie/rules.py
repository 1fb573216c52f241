r"""Sylvie's epoch-level controllers: decisions on the global training loss, no communication.

Two rules watch the global training loss :math:`L_t` (identical on every rank, so every rank
decides the same) and steer :class:`~lightning_fullgraph.comm.policies.sylvie.policy.SylviePolicy`:

* :class:`DivergenceGuard` -- the safety net (on by default).  The stale pipeline can make
  training diverge where halo rows carry much of the aggregation (measured: a 12k-node,
  16-class graph whose halo rows are 55 % of the aggregation inputs, 4 ranks, GCN 3 x 256,
  Adam 0.01: best validation accuracy 0.58 against 0.91 synchronous, the loss climbing from 1.0
  to 4.9 within 7 asynchronous epochs).  After an epoch that used stale values, a loss
  :math:`L_t > L^* + \tau \max(L^*, L_0 / 2)`, with :math:`L^* = \min_{s < t} L_s` and
  :math:`L_0` the first epoch's loss, runs the next ``cooldown`` epochs synchronous; each
  further reaction doubles the cooldown (exponential back-off), so a pipeline that keeps
  diverging ends up off.  The floor :math:`L_0 / 2` measures a rise against the scale of the
  training's progress, not against a small loss: late in training, dropout makes a loss of
  0.05 read 0.08 the next epoch (Cora, hidden 16, 2 ranks: a purely relative test reacted 5
  times in 200 epochs without any divergence); the collapses measured rose by 0.2 to 1.3 with
  :math:`L_0 = 2.8`.

* :class:`LossRateAdaptor` -- Sylvie's Bounded Staleness Adaptor as the seed code
  (zxmeng98/Sylvie) describes it: from epoch ``start`` on, it smooths the loss,
  :math:`\bar L_t = m \bar L_{t-1} + (1 - m) L_t`, and reads its rate of decrease per second of
  training, :math:`r_t = (\bar L_{t-1} - \bar L_t) / \Delta_t`.  When the last ``window``
  rates fall strictly (a monotone slowdown) the bits double and the pipeline turns off
  (synchronous epochs); when they rise strictly (a monotone speed-up) the bits halve and the
  pipeline turns back on; otherwise nothing changes.  After a change the window starts over.
  ``per="epoch"`` reads the decrease per epoch instead, :math:`r_t = \bar L_{t-1} - \bar L_t`:
  the same rule on the loss alone, so two runs with the same seed decide the same (wall-clock
  noise decides nothing), at the cost of the seed's time trade-off (a raised bit-width that
  lengthens the epoch does not by itself read as a slowdown).

Both are plain state (numbers and lists) that round-trips through ``state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DivergenceGuard", "GuardReaction", "LossRateAdaptor"]


@dataclass(frozen=True)
class GuardReaction:
    """One reaction of :class:`DivergenceGuard`: at the end of ``epoch`` the loss was ``loss``
    against a best of ``best``; epochs ``epoch + 1 .. until`` run synchronous."""

    epoch: int
    loss: float
    best: float
    until: int

    def message(self, final_epoch: int | None) -> str:
        rise = 100.0 * (self.loss / self.best - 1.0) if self.best > 0 else math.inf
        span = (
            f"the pipeline is off for the rest of the run (to epoch {final_epoch})"
            if final_epoch is not None and self.until >= final_epoch
            else f"epochs {self.epoch + 1}-{self.until} run synchronous"
        )
        return (
            f"sylvie: the training loss rose {rise:.0f}% above its best ({self.best:.4g} -> {self.loss:.4g}) "
            f"under stale halo values at epoch {self.epoch}; {span}"
        )


@dataclass
class DivergenceGuard:
    r"""Turns the pipeline off for a while when the loss rises under stale values.

    Args:
        tolerance: :math:`\tau > 0`: the relative rise of the loss above its best that counts
            as divergence (dropout makes the loss noisy by a few per cent; 0.1 by default).
        cooldown: Synchronous epochs after the first reaction (``>= 1``); doubled after each
            reaction.

    Invariants: ``best`` is the minimum of every finite loss seen, ``first`` the first one;
    a reaction needs the rise above ``best`` to exceed ``tolerance * max(best, first / 2)``, the epoch
    itself or the one before to have used stale values (a rise under synchronous training is
    not the pipeline's doing), and never happens inside a cooldown it already set.
    """

    tolerance: float = 0.1
    cooldown: int = 10
    best: float = math.inf
    first: float | None = None
    sync_until: int = -1
    next_cooldown: int = 0
    last_stale_epoch: int = -(10**9)
    reactions: list[GuardReaction] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0 and math.isfinite(self.tolerance)):
            raise ValueError(f"guard must be a relative loss rise > 0 (e.g. 0.1) or None (off), got {self.tolerance!r}")
        if not isinstance(self.cooldown, int) or self.cooldown < 1:
            raise ValueError(f"guard_cooldown must be an int >= 1, got {self.cooldown!r}")
        if self.next_cooldown < 1:
            self.next_cooldown = self.cooldown

    def forces_sync(self, epoch: int) -> bool:
        """Whether ``epoch`` lies inside a cooldown."""
        return epoch <= self.sync_until

    def observe(self, epoch: int, loss: float, stale: bool) -> GuardReaction | None:
        """Reads epoch ``epoch``'s global loss; ``stale``: the epoch used stale halo values.
        Returns the reaction, if any (then ``epoch + 1 .. reaction.until`` are synchronous)."""
        if stale:
            self.last_stale_epoch = epoch
        if not math.isfinite(loss):
            return None
        if self.first is None:
            self.first = float(loss)
        reaction = None
        if (
            loss - self.best > self.tolerance * max(self.best, self.first / 2.0)
            and epoch - self.last_stale_epoch <= 1
            and epoch >= self.sync_until
        ):
            self.sync_until = epoch + self.next_cooldown
            self.next_cooldown *= 2
            reaction = GuardReaction(epoch, float(loss), float(self.best), self.sync_until)
            self.reactions.append(reaction)
        self.best = min(self.best, float(loss))
        return reaction

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best, "first": self.first, "sync_until": self.sync_until, "next_cooldown": self.next_cooldown,
            "last_stale_epoch": self.last_stale_epoch,
            "reactions": [(r.epoch, r.loss, r.best, r.until) for r in self.reactions],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.first = None if state.get("first") is None else float(state["first"])
        self.sync_until = int(state["sync_until"])
        self.next_cooldown = int(state["next_cooldown"])
        self.last_stale_epoch = int(state["last_stale_epoch"])
        self.reactions = [GuardReaction(int(e), float(lo), float(b), int(u)) for e, lo, b, u in state["reactions"]]


@dataclass
class LossRateAdaptor:
    r"""Sylvie's Bounded Staleness Adaptor: bits and pipeline from the loss's rate of decrease.

    Args:
        window: Consecutive rates that must fall (or rise) strictly before a change (``>= 2``).
        start: First epoch whose rate counts (the seed starts at epoch 9: early epochs fall fast
            whatever the setting).
        momentum: :math:`m` of the loss's exponential moving average, in ``[0, 1)``.
        per: ``"second"`` (the seed: the decrease per second of training) or ``"epoch"`` (per
            epoch: reproducible).

    :meth:`observe` returns ``"slower"`` (double the bits, pipeline off), ``"faster"`` (halve
    them, pipeline on) or ``None``.
    """

    window: int = 5
    start: int = 9
    momentum: float = 0.9
    per: str = "second"
    smoothed: float | None = None
    rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 2:
            raise ValueError(f"adaptive_window must be an int >= 2, got {self.window!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"the loss momentum must lie in [0, 1), got {self.momentum!r}")
        if self.per not in ("second", "epoch"):
            raise ValueError(f"the adaptor reads the loss's decrease per 'second' or per 'epoch', got {self.per!r}")

    def observe(self, epoch: int, loss: float, seconds: float) -> str | None:
        """Reads epoch ``epoch``'s global loss and its training time in seconds (> 0; unused
        with ``per="epoch"``)."""
        if not math.isfinite(loss):
            return None
        previous = self.smoothed
        self.smoothed = loss if previous is None else self.momentum * previous + (1.0 - self.momentum) * loss
        if self.per == "epoch":
            seconds = 1.0
        if previous is None or epoch < self.start or not seconds > 0:
            return None
        self.rates.append((previous - self.smoothed) / seconds)
        self.rates = self.rates[-self.window :]
        if len(self.rates) < self.window:
            return None
        pairs = list(zip(self.rates, self.rates[1:]))
        if all(b < a for a, b in pairs):
            self.rates.clear()
            return "slower"
        if all(b > a for a, b in pairs):
            self.rates.clear()
            return "faster"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"smoothed": self.smoothed, "rates": list(self.rates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.smoothed = None if state["smoothed"] is None else float(state["smoothed"])
        self.rates = [float(r) for r in state["rates"]]
