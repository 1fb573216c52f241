"""The halo path contract: what a policy's halo path may ask of the exchanger, and its shapes.

The exchanger runs every training layer's differentiable halo exchange through its policy
(:meth:`CompressionPolicy.exchange_halo
<lightning_fullgraph.comm.policies.base.CompressionPolicy.exchange_halo>` and
:meth:`~lightning_fullgraph.comm.policies.base.CompressionPolicy.start_halo`), whatever the
method.  The default path is the exchanger's own synchronous exchange (exact, AdaQP); Sylvie's
pipeline (:mod:`~lightning_fullgraph.comm.policies.sylvie.pipeline`) supplies its own.  A path
sees the exchanger only through :class:`Exchanger`, so neither side imports the other.

Output convention of a path: the halo rows ``[H_r, *]``, or with ``full`` ``cat(x, halo)``
``[N_r + H_r, *]`` (:func:`append_halo`); its backward takes the concatenation's gradient whole
(:func:`split_halo_grad`) and adds the owned rows' part into the rows that come home
(:meth:`Exchanger.add_home`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_fullgraph.comm.codec import ReceivedRows
from lightning_fullgraph.comm.messages import Message
from lightning_fullgraph.comm.plan import HaloPlan
from lightning_fullgraph.comm.transport import CommStats

__all__ = ["Exchanger", "Pending", "append_halo", "halo_buffer", "split_halo_grad"]


class Pending:
    """A halo exchange in flight; :meth:`wait` returns the halo rows."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[], Tensor]) -> None:
        self._finish = finish

    def wait(self) -> Tensor:
        return self._finish()


class Exchanger(Protocol):
    """What a halo path may use of the exchanger
    (:class:`~lightning_fullgraph.comm.exchange.HaloExchanger`)."""

    @property
    def plan(self) -> HaloPlan: ...

    @property
    def stats(self) -> CommStats: ...

    def check_rows(self, x: Tensor) -> None:
        """Refuses ``x`` unless it has the rows this rank owns."""
        ...

    def fetch(self, x: Tensor, layer: int | None = None, kind: str = "message", full: bool = False) -> Tensor:
        """Halo rows of ``x`` (no autograd), waited for (with ``full``: ``cat(x, halo)``)."""
        ...

    def launch(
        self, rows: Tensor, layer: int | None, direction: str, kind: str = "message",
        out: Tensor | None = None, index: Tensor | None = None,
    ) -> Message:
        """Starts one message of ``rows`` (sent rows forward, halo-row gradients backward;
        ``rows[index]`` with ``index``)."""
        ...

    def send_forward(self, x: Tensor, layer: int | None, kind: str = "message", out: Tensor | None = None) -> Message:
        """Starts the forward message of the halo rows of ``x`` (the rows this rank owns)."""
        ...

    def add_home(self, recv: Tensor | ReceivedRows | Message, owned: Tensor | None = None) -> Tensor:
        """Received gradient rows ``[S, *]`` (the rows, a message kept as it arrived, or one in
        flight) summed at their owners ``[N_r, *]`` (plus ``owned``)."""
        ...

    def exchange_synchronous(self, x: Tensor, layer: int | None, full: bool = False) -> Tensor:
        """The synchronous differentiable exchange of ``x``'s halo rows (the default path)."""
        ...

    def start_overlapped(self, x: Tensor, layer: int | None) -> Pending:
        """The overlapped differentiable exchange (the default path's :meth:`start_halo`)."""
        ...


def append_halo(x: Tensor, rows: Tensor, full: bool) -> Tensor:
    """A path's output: ``cat(x, rows)`` with ``full``, else the halo ``rows``."""
    return torch.cat([x, rows], dim=0) if full else rows


def halo_buffer(x: Tensor, num_halo: int) -> tuple[Tensor, Tensor]:
    """``(buffer, halo)``: a new contiguous ``[N_r + H_r, *]`` tensor holding ``x`` in its first
    ``N_r`` rows, and the view of its last ``H_r`` rows, for a message to be received or
    decoded into (what :func:`append_halo` gives with ``full``, without the copy of the halo
    rows)."""
    buffer = x.new_empty((x.size(0) + num_halo,) + tuple(x.shape[1:]))
    buffer[: x.size(0)].copy_(x)
    return buffer, buffer[x.size(0) :]


def split_halo_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None]:
    """(halo rows' gradient, owned rows' gradient or ``None``) of a path's output; ``ctx``
    holds ``full`` and ``num_owned`` from its forward."""
    if not ctx.full:
        return grad, None
    return grad[ctx.num_owned :], grad[: ctx.num_owned]
