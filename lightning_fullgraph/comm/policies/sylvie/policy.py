"""Sylvie's policy: low-bit messages over a bounded-staleness pipeline, and its schedule.

The policy decides, epoch by epoch, whether the epoch is synchronous and whether it sends
rows for the next one; the buffers and the stale path's mechanics are
:mod:`~lightning_fullgraph.comm.policies.sylvie.pipeline`, the two controllers on the global
loss :mod:`~lightning_fullgraph.comm.policies.sylvie.rules`.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_fullgraph.comm.path import Exchanger, Pending
from lightning_fullgraph.comm.policies.adaqp.policy import QuantizedPolicy
from lightning_fullgraph.comm.policies.base import FIXED_BITS, PolicyEnv, check_bits
from lightning_fullgraph.comm.policies.sylvie.pipeline import StalenessState, pipeline_halo
from lightning_fullgraph.comm.policies.sylvie.rules import DivergenceGuard, LossRateAdaptor

__all__ = ["SylviePolicy"]

# what ``epoch_adaptive`` accepts, and the rate each reads
ADAPTIVE_RATES: dict[bool | str, str] = {True: "second", "second": "second", "epoch": "epoch", "auto": "auto"}


class SylviePolicy(QuantizedPolicy):
    r"""Sylvie (arXiv 2303.01277): low-bit messages over a bounded-staleness pipeline.

    Epoch :math:`t` is synchronous when :math:`t \bmod \varepsilon = 0`, when the pipeline is
    off (the epoch-adaptive rule turned it off) or inside a cooldown of the divergence guard;
    otherwise each layer consumes the halo rows and gradients received during epoch
    :math:`t-1`, and sends this epoch's for epoch :math:`t+1` -- unless epoch :math:`t+1` is
    synchronous or the last one, which would throw them away.  See
    :mod:`~lightning_fullgraph.comm.policies.sylvie.pipeline` for the exact schedule and
    :mod:`~lightning_fullgraph.comm.policies.sylvie.rules` for the two controllers.

    Args:
        bits: 1 (default), 2, 4 or 8 fixed; 32 (fp32 through the pipeline); or ``"adaptive"``:
            AdaQP's assignment (settings as in :class:`AdaQPPolicy`) inside the pipeline.
        staleness: ``eps >= 1``: every ``eps``-th epoch is synchronous, so at most ``eps - 1``
            consecutive epochs use one-epoch-old values.
        smoothing: PipeGCN momentum ``gamma`` in ``[0, 1)`` for stale values, or ``None``.
        smooth: ``"features"``, ``"gradients"`` or ``"both"``.
        epoch_adaptive: Sylvie's Bounded Staleness Adaptor
            (:class:`~lightning_fullgraph.comm.policies.sylvie.rules.LossRateAdaptor`): on a monotone
            slowdown of the smoothed global loss's decrease over ``adaptive_window`` epochs (from
            epoch 9), double the bits (at most 8) and turn the pipeline off; on a monotone
            speed-up halve them (at least 1) and turn it back on (not above ``max_halo_share``).
            Decided at the end of epoch :math:`t`, applied from :math:`t+1`.  ``True`` or
            ``"second"``: the seed's rule, on the decrease per second of training (two runs with
            the same seed can decide differently); ``"epoch"``: on the decrease per epoch
            (reproducible); ``"auto"`` (default): ``"epoch"`` where the halo share is at or above
            ``max_halo_share`` (every epoch synchronous: the raised bits are what buys back
            one-bit messages' accuracy there), off otherwise and with non-fixed ``bits``;
            ``False``: off.
        adaptive_window: The adaptor's window of epochs (``>= 2``).
        guard: Divergence guard (:class:`~lightning_fullgraph.comm.policies.sylvie.rules.
            DivergenceGuard`): after an epoch on stale values, a global training loss above its
            best by more than ``guard * max(best, first loss / 2)`` runs the next ``guard_cooldown`` epochs
            synchronous, the cooldown doubling with every reaction; each reaction is logged
            (``comm/guard_reactions``) and printed on rank 0.  ``False`` or ``None`` turns it
            off; ``True`` means 0.1.
        guard_cooldown: Synchronous epochs after the guard's first reaction.
        max_halo_share: The pipeline runs only while halo rows are less than this share of the
            graph's aggregation inputs (default 0.2); at or above it every epoch is synchronous,
            still at ``bits``, and a line says so.  Measured: at a 55 % share the stale pipeline
            collapsed training (best validation accuracy 0.58 against 0.91), synchronous 1-bit
            messages matched fp32.  ``1.0`` pipelines whatever the share.

    With ``bits="adaptive"`` AdaQP's link-aware MILP assigns 2/4/8 bits per row group and
    direction inside this schedule.  PipeQS (ECML-PKDD 2025, suupahako/PipeQS-code)
    combines the two differently: it moves one bit-width per layer and direction up or down
    from the drift between consecutive received blocks (inverted cosine similarity) and lets a
    layer keep its stale block while a transfer is late; that rule is not implemented here.
    """

    name = "sylvie"

    def __init__(
        self,
        bits: int | str = 1,
        staleness: int = 5,
        smoothing: float | None = None,
        smooth: str = "both",
        epoch_adaptive: bool | str = "auto",
        adaptive_window: int = 5,
        guard: float | bool | None = 0.1,
        guard_cooldown: int = 10,
        max_halo_share: float = 0.2,
        assign_every: int = 50,
        first_assign: int = 5,
        lambda_: float = 0.5,
        group_size: int = 100,
        link_costs: str = "measure",
        seed: int = 0,
    ) -> None:
        check_bits(bits, ("adaptive", *FIXED_BITS, 32), "SylviePolicy")
        rate = ADAPTIVE_RATES.get(epoch_adaptive) if isinstance(epoch_adaptive, (bool, str)) else None
        if rate is None and epoch_adaptive not in (False, None):
            raise ValueError(
                f"epoch_adaptive must be one of False, True, 'second', 'epoch', 'auto'; got {epoch_adaptive!r}"
            )
        if rate in ("second", "epoch") and bits not in FIXED_BITS:
            raise ValueError(
                f"epoch_adaptive doubles and halves a fixed bit-width (1, 2, 4 or 8); got bits={bits!r}"
            )
        super().__init__(bits, seed, assign_every, first_assign, lambda_, group_size, link_costs)
        self._state = StalenessState(staleness, smoothing, smooth)
        # whether this epoch sends its rows for the next one (decided with ``synchronous``)
        self.launch = False
        # the setting as given ("auto" decides at setup, from the halo share)
        self.adaptive_rate: str | None = rate if bits in FIXED_BITS else None
        self.adaptor = (
            LossRateAdaptor(window=adaptive_window, per="epoch" if rate == "auto" else rate)
            if self.adaptive_rate is not None
            else None
        )
        if not 0.0 < max_halo_share <= 1.0:
            raise ValueError(f"max_halo_share must lie in (0, 1], got {max_halo_share!r}")
        self.max_halo_share = float(max_halo_share)
        if guard is True:
            guard = 0.1
        self.guard = DivergenceGuard(guard, guard_cooldown) if guard not in (None, False) else None
        # the adaptor's switch: False runs every epoch synchronous
        self.pipelined = True
        # False where the halo share is at or above max_halo_share (set at setup)
        self.pipeline_allowed = True
        self.halo_share = 0.0
        self.last_loss = math.nan
        self.final_epoch: int | None = None

    @property
    def staleness(self) -> int:
        return self._state.staleness

    @property
    def pipeline(self) -> StalenessState:
        """The pipeline's buffers."""
        return self._state

    def exchange_halo(self, exchanger: Exchanger, x: Tensor, layer: int, full: bool = False) -> Tensor:
        """The pipeline's halo path (:func:`~lightning_fullgraph.comm.policies.sylvie.pipeline.
        pipeline_halo`): this epoch's schedule decides synchronous or stale."""
        return pipeline_halo(exchanger, self._state, self, x, layer, full)

    def start_halo(self, exchanger: Exchanger, x: Tensor, layer: int) -> Pending:
        # the pipeline already hides the transfer; no second overlap mechanism
        halo = self.exchange_halo(exchanger, x, layer)
        return Pending(lambda: halo)

    @property
    def epoch_adaptive(self) -> bool:
        """Whether the Bounded Staleness Adaptor runs (``"auto"`` is settled at setup)."""
        return self.adaptor is not None

    @property
    def needs_global_loss(self) -> bool:
        return self.epoch_adaptive or self.guard is not None

    def setup(self, env: PolicyEnv) -> None:
        super().setup(env)
        self.final_epoch = env.final_epoch
        self.halo_share = env.halo_share
        # the share limit binds the adaptor too: it may change bits, not restart the pipeline
        self.pipeline_allowed = not (self.max_halo_share < 1.0 and env.halo_share >= self.max_halo_share)
        if self.adaptive_rate == "auto" and self.pipeline_allowed:
            self.adaptor = None
        if env.fitting and not self.pipeline_allowed:
            self.pipelined = False
            adapting = (
                "; the bits double when the loss's decrease per epoch slows (epoch_adaptive='auto')"
                if self.adaptive_rate == "auto" and self.adaptor is not None
                else ""
            )
            rank_zero_warn(
                f"sylvie: halo rows are {100 * env.halo_share:.0f}% of the aggregation inputs (>= "
                f"max_halo_share={self.max_halo_share:g}), where the stale pipeline diverges; every epoch "
                f"runs synchronous at {self.bits} bit(s){adapting}. Set max_halo_share=1.0 to pipeline anyway"
            )

    def is_sync(self, epoch: int) -> bool:
        """Whether ``epoch`` exchanges fresh rows (a function of the settings and of the
        controllers' decisions taken at the end of earlier epochs)."""
        return (
            epoch % self.staleness == 0
            or not self.pipelined
            or (self.guard is not None and self.guard.forces_sync(epoch))
        )

    def on_train_epoch_start(self, epoch: int) -> dict[str, float]:
        figures = self._assign(epoch)
        self.synchronous = self.is_sync(epoch)
        if not self.synchronous and not self._state.holds_blocks_of(epoch - 1):
            # The bound is one epoch: a stale epoch consumes only blocks sent in the epoch
            # before.  After a resume (the checkpoint's last epoch sent nothing, or its state
            # was reset for another world size) the pipeline holds older blocks or none:
            # consuming them would use rows two or more epochs old and add a gradient block a
            # second time, so this epoch exchanges fresh ones instead.
            self.synchronous = True
            rank_zero_info(
                f"sylvie: epoch {epoch} runs synchronous: the pipeline holds no halo block of epoch "
                f"{epoch - 1} (resumed from a checkpoint), and the staleness bound is one epoch"
            )
        # sends of this epoch are consumed by the next one, unless it is synchronous (fresh
        # rows replace them) or there is none
        last = self.final_epoch is not None and epoch >= self.final_epoch
        # (a synchronous epoch keeps what it exchanged; it launches nothing)
        self.launch = not self.synchronous and not self.synchronous_next(epoch) and not last
        self._state.begin_epoch(epoch, self.synchronous)
        return figures

    def synchronous_next(self, epoch: int) -> bool:
        return self.is_sync(epoch + 1)

    def on_train_epoch_end(
        self, epoch: int, global_loss: float | None, seconds: float | None = None
    ) -> dict[str, float]:
        """Runs the controllers on the global loss of ``epoch`` (and its training time in
        seconds, the mean over ranks).  A decision applies from epoch ``epoch + 1``: transfers
        launched for it are landed (and counted) before its fresh exchange replaces them."""
        if global_loss is None:
            return {}
        self.last_loss = float(global_loss)
        figures = {"comm/global_loss": float(global_loss)}
        stale = not self.synchronous
        if self.adaptor is not None and seconds is not None and self.uniform_bits in FIXED_BITS:
            change = self.adaptor.observe(epoch, float(global_loss), seconds)
            if change == "slower":
                self.uniform_bits, self.pipelined = min(8, self.uniform_bits * 2), False
            elif change == "faster":
                self.uniform_bits, self.pipelined = max(1, self.uniform_bits // 2), self.pipeline_allowed
            if change is not None:
                rank_zero_info(
                    f"sylvie: the loss's decrease per {self.adaptor.per} {'slowed' if change == 'slower' else 'sped up'} "
                    f"for {self.adaptor.window} epochs; from epoch {epoch + 1}: {self.uniform_bits} bits, "
                    f"pipeline {'on' if self.pipelined else 'off'}"
                )
            figures["comm/pipeline_on"] = float(self.pipelined)
        if self.guard is not None and not (self.env is not None and self.env.compute_only):
            # (under the compute-only bound the loss comes from zeroed halo rows: a reaction to
            # it would give the bound another schedule than the mode it bounds)
            reaction = self.guard.observe(epoch, float(global_loss), stale)
            if reaction is not None:
                rank_zero_warn(reaction.message(self.final_epoch))
            figures["comm/guard_reactions"] = float(len(self.guard.reactions))
        return figures

    def epoch_figures(self) -> dict[str, float]:
        """``comm/staleness_max``, ``comm/staleness_mean`` (age in epochs of the halo blocks
        the epoch consumed) and ``comm/sync_epoch`` (1 if it exchanged fresh values)."""
        ages = self.halo_ages()
        return {
            "comm/staleness_max": float(max(ages, default=0)),
            "comm/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "comm/sync_epoch": float(self.synchronous),
        }

    def halo_ages(self) -> list[int]:
        """Age in epochs of every halo block this epoch's layers consumed (0: fresh)."""
        return [age for _, _, age in self._state.ages]

    def summary(self, epochs_run: int) -> str | None:
        """One line on what the controllers did over ``epochs_run`` epochs, or ``None`` when
        the pipeline ran as configured."""
        reactions = self.guard.reactions if self.guard is not None else []
        if not reactions:
            return None
        last = reactions[-1]
        if self.final_epoch is not None and last.until >= self.final_epoch:
            tail = "the pipeline was off from then on"
        else:
            assert self.guard is not None
            tail = f"the last epoch's loss was {self.last_loss:.4g} against a best of {self.guard.best:.4g}"
        tail += (
            f"; the stale pipeline does not suit this graph (halo share {100 * self.halo_share:.0f}%): use "
            "staleness=1 (synchronous low-bit messages) or a lower max_halo_share"
        )
        return (
            f"sylvie: the divergence guard turned the stale pipeline off {len(reactions)} time(s) in "
            f"{epochs_run} epochs (at epochs {', '.join(str(r.epoch) for r in reactions)}); {tail}"
        )

    def teardown(self, failed: bool = False) -> None:
        if failed:
            self._state.abandon()
        else:
            self._state.drain()

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        st = self._state
        out.update(staleness=st.staleness, smoothing=st.smoothing, smooth=st.smooth)
        if self.adaptor is not None:
            out.update(epoch_adaptive=self.adaptor.per, adaptive_window=self.adaptor.window)
        elif self.adaptive_rate == "auto":
            out.update(epoch_adaptive="auto")
        if self.guard is not None:
            out.update(guard=self.guard.tolerance, guard_cooldown=self.guard.cooldown)
        out.update(max_halo_share=self.max_halo_share)
        return out

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            pipeline=self._state.state_dict(),
            pipelined=self.pipelined,
            adaptor=None if self.adaptor is None else self.adaptor.state_dict(),
            guard=None if self.guard is None else self.guard.state_dict(),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        device = self.env.device if self.env is not None else None
        if state.get("pipeline") is not None:
            self._state.load_state_dict(state["pipeline"], device)
        self.pipelined = bool(state.get("pipelined", True))
        if self.adaptor is not None and state.get("adaptor") is not None:
            self.adaptor.load_state_dict(state["adaptor"])
        if self.guard is not None and state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])
