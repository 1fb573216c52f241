"""AdaQP's policy: stochastic low-bit messages at fixed or MILP-assigned bit-widths, synchronous.

:class:`QuantizedPolicy` is the machinery the quantized policies share (the rounding stream,
uniform or assigned bits per layer and direction, AdaQP's assignment); Sylvie's policy
(:mod:`~lightning_fullgraph.comm.policies.sylvie.policy`) builds on it, since its
``bits="adaptive"`` runs AdaQP's assignment inside its pipeline.  The assignment itself is
:mod:`~lightning_fullgraph.comm.policies.adaqp.distributed` (across ranks) over
:mod:`~lightning_fullgraph.comm.policies.adaqp.milp` (pure).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fullgraph.comm.policies.adaqp.distributed import (
    MessageStats,
    assign_message_bits,
    profile_links,
    sender_weights,
)
from lightning_fullgraph.comm.policies.adaqp.links import NOMINAL_COST, LinkCost, message_range
from lightning_fullgraph.comm.policies.adaqp.milp import ADAPTIVE_BITS
from lightning_fullgraph.comm.policies.base import FIXED_BITS, CompressionPolicy, PolicyEnv, check_bits
from lightning_fullgraph.comm.quantize import META_NBYTES, prepare_codec

__all__ = ["AdaQPPolicy", "QuantizedPolicy"]


class QuantizedPolicy(CompressionPolicy):
    """Shared machinery of the quantized policies (AdaQP's and Sylvie's): the rounding stream,
    fixed or assigned bit-widths per (layer, direction), and AdaQP's assignment when
    ``bits="adaptive"``."""

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
        # link_costs="measure": the links are profiled at the first assignment (below)
        self._profile_due = False
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
        prepare_codec(env.device)  # a first compilation of the CPU kernels here, not in an epoch
        self._uniform.clear()
        if self.adaptive and env.fitting and plan.world_size > 1 and self._costs is None:
            w = plan.world_size
            if self.link_costs == "uniform":
                self._costs = {(a, b): NOMINAL_COST for a in range(w) for b in range(w) if a != b}
            else:
                # profiled at the first assignment, not here: only then are every layer's
                # width (the hidden widths are the model's) and so each link's real message
                # range known, which the probe must span (AdaQP's profile.py)
                self._profile_due = True

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
        if not self.adaptive or (self._costs is None and not self._profile_due) or not self.row_range:
            return False
        return epoch == self.first_assign or (
            epoch > self.first_assign and (epoch - self.first_assign) % self.assign_every == 0
        )

    def _assign(self, epoch: int) -> dict[str, float]:
        """AdaQP's assignment for every (layer, direction) seen so far (collective)."""
        if not self._assignment_due(epoch):
            return {}
        assert self.env is not None
        env, plan = self.env, self.env.plan
        start = time.perf_counter()
        profiled: dict[str, float] = {}
        if self._costs is None:
            self._costs, profiled = self._profile_links()
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
            lambda_=self.lambda_, group_size=self.group_size, bit_choices=ADAPTIVE_BITS,
        )
        self.assigned.update(tables)
        figures = dict(figures)
        figures["assign_time"] = time.perf_counter() - start  # includes the profile, if one ran
        if profiled:
            figures["assign_profile_time"] = profiled["profile_time"]
        return {f"comm/{k}": float(v) for k, v in figures.items()}

    def _profile_links(self) -> tuple[dict[tuple[int, int], LinkCost], dict[str, float]]:
        """Times every link over the messages it will carry in any (layer, direction) seen so
        far, at the fewest to the most bits (collective; every rank has the same keys)."""
        assert self.env is not None
        env, plan = self.env, self.env.plan
        keys = sorted(self.row_range)
        span = message_range(
            {key: plan.counts(key[1])[0] for key in keys},
            {key: self.feature_dims[key] for key in keys},
            ADAPTIVE_BITS,
            float(META_NBYTES),
        )
        links, figures = profile_links(env.group, plan.rank, plan.world_size, env.device, span)
        self._profile_due = False
        return links.costs, figures

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
            self._costs = {tuple(k): LinkCost(*ab) for k, ab in state["link_costs"].items()}
            self._profile_due = False


class AdaQPPolicy(QuantizedPolicy):
    r"""AdaQP (arXiv 2306.01381): unbiased stochastic quantization, adaptive bit-widths.

    Training messages (forward rows and backward gradients of every layer whose input needs a
    gradient) travel quantized per row; evaluation exchanges fp32.  With ``bits="adaptive"``
    every message travels at 8 bits until epoch ``first_assign``; then, and every
    ``assign_every`` epochs after it, AdaQP's MILP assigns 2, 4 or 8 bits to groups of rows
    for every (layer, direction) from that direction's own statistics
    (:func:`~lightning_fullgraph.comm.policies.adaqp.distributed.assign_message_bits`).

    Args:
        bits: ``"adaptive"`` or a fixed 1, 2, 4 or 8.
        assign_every: Epochs between re-assignments.
        first_assign: Epoch of the first assignment (>= 1; earlier epochs gather statistics).
        lambda_: Weight of variance against time in the objective, in ``[0, 1]``.
        group_size: Rows per group sharing one bit-width.
        link_costs: ``"measure"`` (at the first assignment, time every link over the messages
            it carries and fit its cost, falling back to the pooled fit of all links where a
            link's fit is not physical or not distinguishable from it:
            :mod:`~lightning_fullgraph.comm.policies.adaqp.links`) or ``"uniform"`` (the same
            nominal link everywhere: reproducible assignments).
        seed: Seed of the stochastic rounding (rank ``r`` uses ``seed + r``).
    """

    name = "adaqp"

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
        check_bits(bits, ("adaptive", *FIXED_BITS), "AdaQPPolicy")
        super().__init__(bits, seed, assign_every, first_assign, lambda_, group_size, link_costs)

    def on_train_epoch_start(self, epoch: int) -> dict[str, float]:
        return self._assign(epoch)
