r"""Bounded-staleness pipeline state (Sylvie's asynchronous mode, after PipeGCN).

In an *asynchronous* epoch :math:`t` layer :math:`l` of rank :math:`r` consumes the halo rows
that their owners sent during epoch :math:`t-1` and launches the transfer of its own
boundary rows for epoch :math:`t+1` without waiting; in backward, the halo-row gradients of
epoch :math:`t` are launched likewise and the owners add them in epoch :math:`t+1`:

.. math::
    \mathbf{H}^{(l)}_r[t] = \mathrm{halo}\big(\mathbf{X}^{(l)}[t-1]\big), \qquad
    \nabla \mathbf{X}^{(l)}_q[t] \mathrel{+}= \mathrm{home}\big(\nabla \mathbf{H}^{(l)}[t-1]\big)

Every ``staleness``-th epoch (``epoch % staleness == 0``, epoch 0 included) is
*synchronous*: in-flight transfers are first drained (the reference code races here), then
fresh rows are exchanged and waited for, so no value used is more than ``staleness - 1``
epochs old and the first epoch never feeds zeros to the model.  Gradients still in flight
when a synchronous epoch starts belong to weights already updated; they are drained and
dropped.

Optional PipeGCN smoothing (``smoothing = gamma``): the consumed halo rows and/or returned
gradients are exponential moving averages ``avg <- gamma * avg + (1 - gamma) * received``.

The state (received buffers, their epochs, smoothing averages) is drained into plain tensors
by :meth:`StalenessState.state_dict`, so a checkpoint resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["LayerPipe", "StalenessState"]


@dataclass
class LayerPipe:
    """Pipeline buffers of one layer on one rank.

    Attributes:
        halo: ``[H, F]`` halo rows to consume next (received, or being received).
        halo_epoch: Epoch in which ``halo`` was sent.
        fwd_pending: Waits for the forward transfer in flight and returns its rows.
        fwd_epoch: Epoch in which the in-flight forward transfer was launched.
        grad: ``[S, F]`` stale gradients of the rows this rank sends (to add next backward).
        grad_pending: Waits for the gradient transfer in flight.
        halo_avg, grad_avg: Smoothing averages (``None`` until first use / when off).
    """

    halo: Tensor | None = None
    halo_epoch: int = -1
    fwd_pending: Callable[[], Tensor] | None = None
    fwd_epoch: int = -1
    grad: Tensor | None = None
    grad_pending: Callable[[], Tensor] | None = None
    halo_avg: Tensor | None = None
    grad_avg: Tensor | None = None

    def land_forward(self) -> None:
        """Waits for the forward transfer in flight (if any) and keeps its rows."""
        if self.fwd_pending is not None:
            self.halo = self.fwd_pending()
            self.halo_epoch = self.fwd_epoch
            self.fwd_pending = None

    def land_gradient(self) -> None:
        if self.grad_pending is not None:
            self.grad = self.grad_pending()
            self.grad_pending = None


@dataclass
class StalenessState:
    """Schedule and buffers of the asynchronous pipeline of one rank.

    Args:
        staleness: ``eps >= 1``; every ``eps``-th epoch is synchronous (``1``: always).
        smoothing: PipeGCN momentum ``gamma`` in ``[0, 1)``, or ``None`` (off).
        smooth: What to smooth: ``"features"``, ``"gradients"`` or ``"both"``.
    """

    staleness: int = 5
    smoothing: float | None = None
    smooth: str = "both"
    epoch: int = 0
    force_sync: bool = False
    layers: dict[int, LayerPipe] = field(default_factory=dict)
    # instrumentation: (epoch, layer, age) of every consumed halo block of this epoch
    ages: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.staleness < 1:
            raise ValueError(f"staleness must be >= 1, got {self.staleness}")
        if self.smoothing is not None and not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing must lie in [0, 1), got {self.smoothing}")
        if self.smooth not in ("features", "gradients", "both"):
            raise ValueError(f"smooth={self.smooth!r}; choose features, gradients or both")

    def is_sync(self, epoch: int | None = None) -> bool:
        epoch = self.epoch if epoch is None else epoch
        return self.force_sync or epoch % self.staleness == 0

    def layer(self, index: int) -> LayerPipe:
        return self.layers.setdefault(index, LayerPipe())

    def begin_epoch(self, epoch: int) -> bool:
        """Starts a training step of ``epoch``; drains in-flight transfers before a
        synchronous one. Returns whether the step is synchronous."""
        self.epoch = epoch
        self.ages.clear()
        sync = self.is_sync()
        if sync:
            self.drain(drop_gradients=True)
        return sync

    def drain(self, drop_gradients: bool = False) -> None:
        """Waits for every transfer in flight."""
        for pipe in self.layers.values():
            pipe.land_forward()
            pipe.land_gradient()
            if drop_gradients:
                pipe.grad = None
                pipe.grad_avg = None

    def abandon(self) -> None:
        """Forgets in-flight transfers without waiting (after a failure: a peer may be gone)."""
        for pipe in self.layers.values():
            pipe.fwd_pending = None
            pipe.grad_pending = None

    def smooth_halo(self, pipe: LayerPipe, fresh: bool) -> Tensor:
        assert pipe.halo is not None
        if self.smoothing is None or self.smooth == "gradients":
            return pipe.halo
        if pipe.halo_avg is None:
            pipe.halo_avg = pipe.halo.clone()
        elif fresh:
            pipe.halo_avg.mul_(self.smoothing).add_(pipe.halo, alpha=1.0 - self.smoothing)
        return pipe.halo_avg

    def smooth_grad(self, pipe: LayerPipe, grad: Tensor) -> Tensor:
        if self.smoothing is None or self.smooth == "features":
            return grad
        if pipe.grad_avg is None or pipe.grad_avg.shape != grad.shape:
            pipe.grad_avg = grad.clone()
        else:
            pipe.grad_avg.mul_(self.smoothing).add_(grad, alpha=1.0 - self.smoothing)
        return pipe.grad_avg

    def record_age(self, layer: int, age: int) -> None:
        self.ages.append((self.epoch, layer, age))

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Drains in-flight transfers and returns tensors and counters only."""
        self.drain()
        keys = ("halo", "halo_epoch", "grad", "halo_avg", "grad_avg")
        return {
            "epoch": self.epoch,
            "force_sync": self.force_sync,
            "layers": {i: {k: getattr(p, k) for k in keys} for i, p in self.layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        self.epoch = int(state["epoch"])
        self.force_sync = bool(state.get("force_sync", False))
        self.layers = {}
        for i, entry in state["layers"].items():
            pipe = LayerPipe()
            for k, v in entry.items():
                setattr(pipe, k, v.to(device) if isinstance(v, Tensor) and device is not None else v)
            self.layers[int(i)] = pipe
