r"""The policy contract: what every compression policy answers, its environment, the bit sets.

A policy owns everything a method *decides* about halo messages, in the spirit of torch's DDP
comm-hook state objects (``PowerSGDState``): its settings, validated once in the constructor;
its state, which round-trips through :meth:`~CompressionPolicy.state_dict` (plain tensors and
numbers, no process group); and its per-epoch decisions:

* :meth:`~CompressionPolicy.message_bits` -- the bit-widths of one layer's messages in one
  direction (``None``: fp32), which the exchanger encodes with
  (:mod:`~lightning_fullgraph.comm.codec` around :mod:`~lightning_fullgraph.comm.transport`);
* :meth:`~CompressionPolicy.exchange_halo` / :meth:`~CompressionPolicy.start_halo` -- the
  halo path of a training layer's differentiable exchange (:mod:`~lightning_fullgraph.comm.path`),
  asked of every policy: the exchanger's synchronous / overlapped exchange by default, Sylvie's
  pipeline for Sylvie;
* ``synchronous`` -- whether this epoch exchanges fresh rows (always, but in a pipelined
  policy's asynchronous epochs).

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

Policies (one module each; the mode table in :mod:`~lightning_fullgraph.comm.policies.modes`):

* :class:`~lightning_fullgraph.comm.policies.exact.ExactPolicy` -- fp32, synchronous: identical
  to one process.
* :class:`~lightning_fullgraph.comm.policies.adaqp.policy.AdaQPPolicy` -- stochastic 2/4/8-bit
  messages, unbiased, bit-widths from AdaQP's MILP (``bits="adaptive"``) or fixed; synchronous.
* :class:`~lightning_fullgraph.comm.policies.sylvie.policy.SylviePolicy` -- one-bit (or k-bit,
  or ``"adaptive"``: AdaQP's assignment inside the pipeline) messages over Sylvie's
  bounded-staleness pipeline (:mod:`~lightning_fullgraph.comm.policies.sylvie.pipeline`).

The bit sets: :data:`FIXED_BITS` (below) are the quantizer's record formats
(:data:`~lightning_fullgraph.comm.quantize.SUPPORTED_BITS`, defined there: the codec can send
nothing else); the widths AdaQP's assignment chooses from are
:data:`~lightning_fullgraph.comm.policies.adaqp.milp.ADAPTIVE_BITS`, defined with its MILP.
Directions and the forward/backward count swap are the plan's
(:data:`~lightning_fullgraph.comm.plan.DIRECTIONS`, :meth:`HaloPlan.counts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_fullgraph.comm.path import Exchanger, Pending
from lightning_fullgraph.comm.plan import HaloPlan
from lightning_fullgraph.comm.quantize import SUPPORTED_BITS

__all__ = ["FIXED_BITS", "CompressionPolicy", "ControlFn", "PolicyEnv", "check_bits"]

#: Fixed bit-widths a quantized message can use (the quantizer's formats); Sylvie also takes
#: 32, fp32 through its pipeline.
FIXED_BITS: tuple[int, ...] = SUPPORTED_BITS

#: ``control(rows [sum(send_counts), k], send_counts, recv_counts) -> rows [sum(recv_counts), k]``:
#: a synchronous, uncompressed all-to-all of rows over the halo ranks (collective: every rank
#: calls it at the same point).  ``send_counts[p]`` rows go to rank ``p``, ``recv_counts[p]``
#: come from rank ``p``, concatenated in peer-rank order.
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
    #: the benchmark bound (``FullGraphStrategy(compute_only=True)``): halo rows arrive as zeros,
    #: so the training loss says nothing about the method and no decision may read it
    compute_only: bool = False


class CompressionPolicy:
    """Base class: fp32 messages, every epoch synchronous (the exact method).

    Subclasses override the decisions; the exchanger and the strategy only call the methods
    below.
    """

    #: The mode this policy implements (its row in :mod:`~lightning_fullgraph.comm.policies.
    #: modes`, which holds the description and the overlap default).
    name: ClassVar[str] = "exact"

    def __init__(self) -> None:
        self.env: PolicyEnv | None = None
        # decision of the current epoch: fresh rows (a pipelined policy's schedule changes it)
        self.synchronous = True

    # -- what the exchanger asks ----------------------------------------------------------
    def exchange_halo(self, exchanger: Exchanger, x: Tensor, layer: int, full: bool = False) -> Tensor:
        """The halo path of training layer ``layer`` whose input ``x`` (``[N_r, *]``) needs a
        gradient: the halo rows ``[H_r, *]`` (``cat(x, halo)`` with ``full``), differentiable
        in ``x``.  Default: the exchanger's synchronous exchange."""
        return exchanger.exchange_synchronous(x, layer, full)

    def start_halo(self, exchanger: Exchanger, x: Tensor, layer: int) -> Pending:
        """The same halo rows in flight (``wait()`` gives them).  Default: the exchanger's
        overlapped exchange (the transfers overlap what runs between start and wait, in
        forward and in backward)."""
        return exchanger.start_overlapped(x, layer)

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

    def halo_ages(self) -> list[int] | None:
        """Age in epochs of every halo block the epoch's layers consumed, or ``None`` for a
        policy that keeps no blocks (every exchange fresh)."""
        return None

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


def check_bits(bits: int | str, allowed: tuple[Any, ...], who: str) -> None:
    """Refuses a ``bits`` setting outside ``allowed``, naming the constructor ``who``."""
    if bits not in allowed:
        raise ValueError(f"{who}(bits={bits!r}); choose one of {allowed}")
