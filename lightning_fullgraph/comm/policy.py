r"""Compression policies: what each method decides about halo messages, epoch by epoch.

The transport (:mod:`~lightning_fullgraph.comm.transport`) moves rows and, when handed
bit-widths, runs the codec (:mod:`~lightning_fullgraph.comm.codec`) around the collective.
A policy owns everything a method *decides*, in the spirit of torch's DDP comm-hook state
objects (``PowerSGDState``): its settings, validated once in the constructor; its state, which
round-trips through :meth:`~CompressionPolicy.state_dict` (plain tensors and numbers, no process
group); and its per-epoch decisions:

* :meth:`~CompressionPolicy.message_bits` -- the bit-widths of one layer's messages in one
  direction (``None``: fp32), handed to the transport;
* ``synchronous`` / ``launch`` -- for a pipelined policy, whether this epoch exchanges fresh
  rows, and whether it sends rows for the next epoch.

The strategy calls the lifecycle hooks, identically on every rank:

====================================  =======================================================
``setup(env)``                        once per fit/validate/...; may run collectives
``on_train_epoch_start(epoch)``       before the training step; may run collectives (AdaQP's
                                      assignment); returns figures to log
``on_train_epoch_end(epoch, loss,     after backward; ``loss`` is the global training loss
seconds)``                            when ``needs_global_loss`` (else ``None``), ``seconds``
                                      the epoch's mean forward + backward time
``teardown(failed)``                  waits for (or, after a failure, forgets) transfers
====================================  =======================================================

Policies:

* :class:`ExactPolicy` -- fp32, synchronous: identical to one process.
* :class:`AdaQPPolicy` -- stochastic 2/4/8-bit messages, unbiased, bit-widths from AdaQP's MILP
  (``bits="adaptive"``) or fixed; synchronous.
* :class:`SylviePolicy` -- one-bit (or k-bit, or ``"adaptive"``: AdaQP's assignment inside the
  pipeline) messages over Sylvie's bounded-staleness pipeline
  (:mod:`~lightning_fullgraph.comm.staleness`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_fullgraph.comm.plan import DIRECTIONS, HaloPlan
from lightning_fullgraph.comm.quantize import ADAPTIVE_BITS, SUPPORTED_BITS
from lightning_fullgraph.comm.staleness import StalenessState
from lightning_fullgraph.comm.sylvie_rules import DivergenceGuard, LossRateAdaptor

__all__ = [
    "ADAPTIVE_BIT_CHOICES",
    "AdaQPPolicy",
    "CompressionPolicy",
    "DIRECTIONS",
    "ExactPolicy",
    "FIXED_BITS",
    "PolicyEnv",
    "SylviePolicy",
    "make_policy",
    "policy_settings",
]

#: Fixed bit-widths a quantized message can use; 32 sends fp32 (through Sylvie's pipeline).
FIXED_BITS: tuple[int, ...] = SUPPORTED_BITS
#: Bit-widths AdaQP's assignment chooses from (defined with the assignment).
ADAPTIVE_BIT_CHOICES: tuple[int, ...] = ADAPTIVE_BITS

ControlFn = Callable[[Tensor, list[int], list[int]], Tensor]


@dataclass
class PolicyEnv:
    """What a policy may use at setup: this rank's plan, the halo process group, the device,
    and ``control``, an uncompressed all-to-all of small control rows (counted as control
    traffic, sent even by the ``compute_only`` bound)."""

    plan: HaloPlan
    group: Any
    device: torch.device
    control: ControlFn
    fitting: bool = True
    final_epoch: int | None = None
    #: halo rows' share of the aggregation inputs of the whole graph (edges from halo rows over
    #: all edges plus one self term per node; the same on every rank)
    halo_share: float = 0.0


class CompressionPolicy:
    """Base class: fp32 messages, every epoch synchronous (the exact method).

    Subclasses override the decisions; the transport and the strategy only call the methods
    below.
    """

    name: ClassVar[str] = "exact"
    #: One line for Lightning's strategy registry (``fullgraph_<name>``).
    description: ClassVar[str] = "exact fp32 halo exchange"
    #: Whether central/marginal overlap is on unless ``FullGraphStrategy(overlap=...)`` says.
    overlap_by_default: ClassVar[bool] = False

    def __init__(self) -> None:
        self.env: PolicyEnv | None = None
        # decisions of the current epoch (read by the exchanger)
        self.synchronous = True
        self.launch = False

    # -- what the exchanger asks ----------------------------------------------------------
    @property
    def pipeline(self) -> StalenessState | None:
        """Sylvie's buffers (``None``: every exchange is synchronous)."""
        return None

    @property
    def generator(self) -> torch.Generator | None:
        """Random stream of the stochastic rounding."""
        return None

    @property
    def needs_global_loss(self) -> bool:
        """Whether :meth:`on_train_epoch_end` needs the global training loss (a collective)."""
        return False

    def message_bits(self, layer: int, direction: str) -> tuple[Tensor, Tensor] | None:
        """Bit-widths of ``layer``'s messages in ``direction``: ``(bits of every row this rank
        sends [M], bits of every row it receives [R])`` (uint8), or ``None`` for fp32."""
        return None

    def observe(self, layer: int, direction: str, row_range: Tensor, feature_dim: int) -> None:
        """Per-row ``max - min`` of the rows a compressed message just sent (statistics)."""

    def observe_score(self, layer: int, score: Callable[[], Tensor] | None) -> None:
        """The receiver-side aggregation score of ``layer``'s halo rows (lazy)."""

    # -- lifecycle ------------------------------------------------------------------------
    def setup(self, env: PolicyEnv) -> None:
        self.env = env

    def on_train_epoch_start(self, epoch: int) -> dict[str, float]:
        return {}

    def on_train_epoch_end(
        self, epoch: int, global_loss: float | None, seconds: float | None = None
    ) -> dict[str, float]:
        """``global_loss``: the global training loss of ``epoch`` when ``needs_global_loss``;
        ``seconds``: the epoch's forward + backward time, the mean over ranks (same on all)."""
        return {}

    def epoch_figures(self) -> dict[str, float]:
        """Figures of the epoch that just ran, the same on every rank (logged as they are)."""
        return {}

    def summary(self, epochs_run: int) -> str | None:
        """A line for the end of fit on what the policy's controllers changed, or ``None``."""
        return None

    def teardown(self, failed: bool = False) -> None:
        """Waits for transfers in flight, or forgets them after a failure (a peer may be gone)."""

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy", self.name) != self.name:
            raise ValueError(
                f"the checkpoint holds the state of a {state.get('policy')!r} policy but this run uses "
                f"{self.name!r}; resume with the mode the checkpoint was written with"
            )

    def settings(self) -> dict[str, Any]:
        """The constructor arguments (for logs and benchmarks)."""
        return {}

    def __getstate__(self) -> dict[str, Any]:
        # a policy is picklable without its environment (the process group cannot be pickled)
        state = dict(self.__dict__)
        state["env"] = None
        return state

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


class ExactPolicy(CompressionPolicy):
    """fp32 messages, synchronous: the distributed run equals single-process training.

    Args:
        seed: Unused (nothing is random); accepted so that one configuration can switch modes.
    """

    name = "exact"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed


def _check_bits(bits: int | str, allowed: tuple[Any, ...], who: str) -> None:
    if bits not in allowed:
        raise ValueError(f"{who}(bits={bits!r}); choose one of {allowed}")


class _QuantizedPolicy(CompressionPolicy):
    """Shared machinery of the quantized policies: the rounding stream, fixed or assigned
    bit-widths per (layer, direction), and AdaQP's assignment when ``bits="adaptive"``."""

    def __init__(
        self,
        bits: int | str,
        seed: int,
        assign_every: int,
        first_assign: int,
        lambda_: float,
        group_size: int,
        link_costs: str,
    ) -> None:
        super().__init__()
        if assign_every < 1 or group_size < 1:
            raise ValueError(f"assign_every and group_size must be >= 1, got {assign_every} and {group_size}")
        if first_assign < 1:
            raise ValueError(f"first_assign must be >= 1 (epoch 0 gathers the statistics), got {first_assign}")
        if not 0.0 <= lambda_ <= 1.0:
            raise ValueError(f"lambda_ must lie in [0, 1], got {lambda_}")
        if link_costs not in ("measure", "uniform"):
            raise ValueError(f"link_costs={link_costs!r}; choose 'measure' or 'uniform'")
        self.bits = bits
        self.seed = seed
        self.assign_every = assign_every
        self.first_assign = first_assign
        self.lambda_ = lambda_
        self.group_size = group_size
        self.link_costs = link_costs
        # uniform bits used where no assignment exists (adaptive: 8 until the first one)
        self.uniform_bits: int | None = None if bits == 32 else (8 if bits == "adaptive" else int(bits))
        self._generator: torch.Generator | None = None
        self.assigned: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        self.row_range: dict[tuple[int, str], Tensor] = {}
        self.feature_dims: dict[tuple[int, str], int] = {}
        self._scores: dict[int, Callable[[], Tensor] | None] = {}
        self._sender_weights: dict[int, Tensor] = {}
        self._costs: dict[tuple[int, int], Any] | None = None
        self._uniform: dict[tuple[int, int], Tensor] = {}

    @property
    def adaptive(self) -> bool:
        return self.bits == "adaptive"

    @property
    def generator(self) -> torch.Generator | None:
        return self._generator

    def setup(self, env: PolicyEnv) -> None:
        super().setup(env)
        plan = env.plan
        self._generator = torch.Generator(device=env.device).manual_seed(self.seed + plan.rank)
        self._uniform.clear()
        if self.adaptive and env.fitting and plan.world_size > 1 and self._costs is None:
            from lightning_fullgraph.comm.adaptive import measure_link_costs
            from lightning_fullgraph.comm.assign import LinkCost

            w = plan.world_size
            if self.link_costs == "uniform":
                self._costs = {(a, b): LinkCost(1e-9, 1e-4) for a in range(w) for b in range(w) if a != b}
            else:
                self._costs = measure_link_costs(env.group, plan.rank, w, env.device)

    def _full(self, bits: int, n: int) -> Tensor:
        key = (bits, n)
        t = self._uniform.get(key)
        if t is None:
            assert self.env is not None
            t = self._uniform[key] = torch.full((n,), bits, dtype=torch.uint8, device=self.env.device)
        return t

    def message_bits(self, layer: int, direction: str) -> tuple[Tensor, Tensor] | None:
        table = self.assigned.get((layer, direction))
        if table is not None:
            return table
        if self.uniform_bits is None:
            return None
        assert self.env is not None
        plan = self.env.plan
        sent, received = plan.rows(direction)
        return self._full(self.uniform_bits, sent), self._full(self.uniform_bits, received)

    def observe(self, layer: int, direction: str, row_range: Tensor, feature_dim: int) -> None:
        if self.adaptive:
            self.row_range[(layer, direction)] = row_range
            self.feature_dims[(layer, direction)] = feature_dim

    def observe_score(self, layer: int, score: Callable[[], Tensor] | None) -> None:
        if self.adaptive and layer not in self._scores:
            self._scores[layer] = score

    def _assignment_due(self, epoch: int) -> bool:
        if not self.adaptive or self._costs is None or not self.row_range:
            return False
        return epoch == self.first_assign or (
            epoch > self.first_assign and (epoch - self.first_assign) % self.assign_every == 0
        )

    def _assign(self, epoch: int) -> dict[str, float]:
        """AdaQP's assignment for every (layer, direction) seen so far (collective)."""
        if not self._assignment_due(epoch):
            return {}
        from lightning_fullgraph.comm.adaptive import MessageStats, assign_message_bits, sender_weights

        assert self.env is not None and self._costs is not None
        env, plan = self.env, self.env.plan
        start = time.perf_counter()
        stats: dict[tuple[int, str], MessageStats] = {}
        for key in sorted(self.row_range):
            layer, direction = key
            rng = self.row_range[key]
            if direction == "forward":
                if layer not in self._sender_weights:
                    score_fn = self._scores.get(layer)
                    score = score_fn() if score_fn is not None else None
                    if score is None:
                        score = torch.ones(plan.num_halo, dtype=torch.float32, device=env.device)
                    self._sender_weights[layer] = sender_weights(
                        score.to(env.device, torch.float32), plan.send_counts, plan.recv_counts, env.control
                    )
                weight = self._sender_weights[layer]
            else:
                # a gradient row is added into its owner's gradient as it is: coefficient 1
                weight = torch.ones_like(rng, dtype=torch.float32)
            counts = plan.counts(direction)
            stats[key] = MessageStats(
                row_range=rng.float(), weight=weight, feature_dim=self.feature_dims[key],
                send_counts=list(counts[0]), recv_counts=list(counts[1]),
            )
        tables, figures = assign_message_bits(
            stats, plan.rank, plan.world_size, env.group, self._costs, env.control,
            lambda_=self.lambda_, group_size=self.group_size, bit_choices=ADAPTIVE_BIT_CHOICES,
        )
        self.assigned.update(tables)
        figures = dict(figures)
        figures["assign_time"] = time.perf_counter() - start
        return {f"comm/{k}": float(v) for k, v in figures.items()}

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bits": self.bits, "seed": self.seed}
        if self.adaptive:
            out.update(
                assign_every=self.assign_every, first_assign=self.first_assign, lambda_=self.lambda_,
                group_size=self.group_size, link_costs=self.link_costs,
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            generator=self._generator.get_state() if self._generator is not None else None,
            uniform_bits=self.uniform_bits,
            assigned={k: (a.cpu(), b.cpu()) for k, (a, b) in self.assigned.items()},
            row_range={k: v.cpu() for k, v in self.row_range.items()},
            feature_dims=dict(self.feature_dims),
            sender_weights={k: v.cpu() for k, v in self._sender_weights.items()},
            # the assignment must see the links the interrupted run measured
            link_costs=None if self._costs is None else {k: (c.alpha, c.beta) for k, c in self._costs.items()},
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        device = self.env.device if self.env is not None else torch.device("cpu")
        if state.get("generator") is not None and self._generator is not None:
            self._generator.set_state(state["generator"])
        self.uniform_bits = state.get("uniform_bits", self.uniform_bits)
        self.assigned = {tuple(k): (a.to(device), b.to(device)) for k, (a, b) in state.get("assigned", {}).items()}
        self.row_range = {tuple(k): v.to(device) for k, v in state.get("row_range", {}).items()}
        self.feature_dims = {tuple(k): int(v) for k, v in state.get("feature_dims", {}).items()}
        self._sender_weights = {int(k): v.to(device) for k, v in state.get("sender_weights", {}).items()}
        if state.get("link_costs") is not None:
            from lightning_fullgraph.comm.assign import LinkCost

            self._costs = {tuple(k): LinkCost(*ab) for k, ab in state["link_costs"].items()}


class AdaQPPolicy(_QuantizedPolicy):
    r"""AdaQP (arXiv 2306.01381): unbiased stochastic quantization, adaptive bit-widths.

    Training messages (forward rows and backward gradients of every layer whose input needs a
    gradient) travel quantized per row; evaluation exchanges fp32.  With ``bits="adaptive"``
    every message travels at 8 bits until epoch ``first_assign``; then, and every
    ``assign_every`` epochs after it, AdaQP's MILP assigns 2, 4 or 8 bits to groups of rows
    for every (layer, direction) from that direction's own statistics
    (:func:`~lightning_fullgraph.comm.adaptive.assign_message_bits`).

    Args:
        bits: ``"adaptive"`` or a fixed 1, 2, 4 or 8.
        assign_every: Epochs between re-assignments.
        first_assign: Epoch of the first assignment (>= 1; earlier epochs gather statistics).
        lambda_: Weight of variance against time in the objective, in ``[0, 1]``.
        group_size: Rows per group sharing one bit-width.
        link_costs: ``"measure"`` (time every link at setup) or ``"uniform"`` (the same nominal
            link everywhere: reproducible assignments).
        seed: Seed of the stochastic rounding (rank ``r`` uses ``seed + r``).
    """

    name = "adaqp"
    description = "AdaQP: adaptive stochastic 2/4/8-bit messages"
    overlap_by_default = True

    def __init__(
        self,
        bits: int | str = "adaptive",
        assign_every: int = 50,
        first_assign: int = 5,
        lambda_: float = 0.5,
        group_size: int = 100,
        link_costs: str = "measure",
        seed: int = 0,
    ) -> None:
        _check_bits(bits, ("adaptive", *FIXED_BITS), "AdaQPPolicy")
        super().__init__(bits, seed, assign_every, first_assign, lambda_, group_size, link_costs)

    def on_train_epoch_start(self, epoch: int) -> dict[str, float]:
        return self._assign(epoch)


class SylviePolicy(_QuantizedPolicy):
    r"""Sylvie (arXiv 2303.01277): low-bit messages over a bounded-staleness pipeline.

    Epoch :math:`t` is synchronous when :math:`t \bmod \varepsilon = 0`, when the pipeline is
    off (the epoch-adaptive rule turned it off) or inside a cooldown of the divergence guard;
    otherwise each layer consumes the halo rows and gradients received during epoch
    :math:`t-1`, and sends this epoch's for epoch :math:`t+1` -- unless epoch :math:`t+1` is
    synchronous or the last one, which would throw them away.  See
    :mod:`~lightning_fullgraph.comm.staleness` for the exact schedule and
    :mod:`~lightning_fullgraph.comm.sylvie_rules` for the two controllers.

    Args:
        bits: 1 (default), 2, 4 or 8 fixed; 32 (fp32 through the pipeline); or ``"adaptive"``:
            AdaQP's assignment (settings as in :class:`AdaQPPolicy`) inside the pipeline.
        staleness: ``eps >= 1``: every ``eps``-th epoch is synchronous, so at most ``eps - 1``
            consecutive epochs use one-epoch-old values.
        smoothing: PipeGCN momentum ``gamma`` in ``[0, 1)`` for stale values, or ``None``.
        smooth: ``"features"``, ``"gradients"`` or ``"both"``.
        epoch_adaptive: Sylvie's Bounded Staleness Adaptor
            (:class:`~lightning_fullgraph.comm.sylvie_rules.LossRateAdaptor`): on a monotone
            slowdown of the smoothed global loss's decrease per second over
            ``adaptive_window`` epochs (from epoch 9), double the bits (at most 8) and turn the
            pipeline off; on a monotone speed-up halve them (at least 1) and turn it back on.
            Decided at the end of epoch :math:`t`, applied from :math:`t+1`.
        adaptive_window: The adaptor's window of epochs (``>= 2``).
        guard: Divergence guard (:class:`~lightning_fullgraph.comm.sylvie_rules.
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
    description = "Sylvie: one-bit messages, bounded-staleness pipeline"

    def __init__(
        self,
        bits: int | str = 1,
        staleness: int = 5,
        smoothing: float | None = None,
        smooth: str = "both",
        epoch_adaptive: bool = False,
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
        _check_bits(bits, ("adaptive", *FIXED_BITS, 32), "SylviePolicy")
        if epoch_adaptive and bits not in FIXED_BITS:
            raise ValueError(
                f"epoch_adaptive doubles and halves a fixed bit-width (1, 2, 4 or 8); got bits={bits!r}"
            )
        super().__init__(bits, seed, assign_every, first_assign, lambda_, group_size, link_costs)
        self._state = StalenessState(staleness, smoothing, smooth)
        self.epoch_adaptive = bool(epoch_adaptive)
        self.adaptor = LossRateAdaptor(window=adaptive_window) if self.epoch_adaptive else None
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
        return self._state

    @property
    def needs_global_loss(self) -> bool:
        return self.epoch_adaptive or self.guard is not None

    def setup(self, env: PolicyEnv) -> None:
        super().setup(env)
        self.final_epoch = env.final_epoch
        self.halo_share = env.halo_share
        # the share limit binds the adaptor too: it may change bits, not restart the pipeline
        self.pipeline_allowed = not (self.max_halo_share < 1.0 and env.halo_share >= self.max_halo_share)
        if env.fitting and not self.pipeline_allowed:
            self.pipelined = False
            rank_zero_warn(
                f"sylvie: halo rows are {100 * env.halo_share:.0f}% of the aggregation inputs (>= "
                f"max_halo_share={self.max_halo_share:g}), where the stale pipeline diverges; every epoch "
                f"runs synchronous at {self.bits} bit(s). Set max_halo_share=1.0 to pipeline anyway"
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
                    f"sylvie: the loss's decrease per second {'slowed' if change == 'slower' else 'sped up'} "
                    f"for {self.adaptor.window} epochs; from epoch {epoch + 1}: {self.uniform_bits} bits, "
                    f"pipeline {'on' if self.pipelined else 'off'}"
                )
            figures["comm/pipeline_on"] = float(self.pipelined)
        if self.guard is not None:
            reaction = self.guard.observe(epoch, float(global_loss), stale)
            if reaction is not None:
                rank_zero_warn(reaction.message(self.final_epoch))
            figures["comm/guard_reactions"] = float(len(self.guard.reactions))
        return figures

    def epoch_figures(self) -> dict[str, float]:
        """``comm/staleness_max``, ``comm/staleness_mean`` (age in epochs of the halo blocks
        the epoch consumed) and ``comm/sync_epoch`` (1 if it exchanged fresh values)."""
        ages = [age for _, _, age in self._state.ages]
        return {
            "comm/staleness_max": float(max(ages, default=0)),
            "comm/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "comm/sync_epoch": float(self.synchronous),
        }

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
        if self.epoch_adaptive:
            assert self.adaptor is not None
            out.update(epoch_adaptive=True, adaptive_window=self.adaptor.window)
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


POLICIES: dict[str, type[CompressionPolicy]] = {"exact": ExactPolicy, "adaqp": AdaQPPolicy, "sylvie": SylviePolicy}


def policy_settings(mode: str) -> frozenset[str]:
    """The settings ``mode``'s policy takes (its constructor's arguments)."""
    import inspect

    return frozenset(inspect.signature(POLICIES[mode].__init__).parameters) - {"self"}


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

