"""Halo exchange: the transport (one ``all_to_all_single`` per exchange) and its autograd.

Forward, for a layer input ``X_r`` (``[N_r, F]``, the rows rank ``r`` owns)::

    H_r = all_to_all( X_q[send_index_q -> r]  for every rank q )          # [H_r, F]
    X_full_r = cat(X_r, H_r)                                             # [N_r + H_r, F]

Backward, given ``dL/dH_r`` for the borrowed rows, the gradients travel back to their owners
and are *added* into the owners' gradient (a node can be borrowed by several ranks)::

    dL/dX_q += index_add( send_index_q, all_to_all( dL/dH_r  for every rank r ) )

This is the adjoint of the forward gather, so it is exact for directed graphs (no symmetry
is assumed) and for ranks that own no training node (they still send zero gradients).

Halo traffic runs on its own process group so it never interleaves with the gradient
all-reduce on the default group.  Every rank must call :meth:`HaloExchanger.exchange` the
same number of times in the same order (one call per message-passing layer), which holds
because every rank runs the same model.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fullgraph.partition.plan import HaloPlan

__all__ = ["CommStats", "HaloExchanger"]


@dataclass
class CommStats:
    """Counters of halo traffic, reset by the logger at every epoch.

    All byte counts are payload bytes this rank put on / took off the wire (rows sent to
    itself are not counted: a rank never sends to itself).  Times are seconds.
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    exchanges: int = 0
    wait_time: float = 0.0
    forward_exchanges: int = 0
    backward_exchanges: int = 0
    cache_hits: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_recv = self.exchanges = 0
        self.forward_exchanges = self.backward_exchanges = self.cache_hits = 0
        self.wait_time = 0.0
        self.extra.clear()


class HaloExchanger:
    """Moves halo rows between ranks according to a :class:`HaloPlan`.

    Args:
        plan: This rank's plan; its tensors must be on the device the features live on.
        group: Process group for halo traffic (``None``: the default group).  With a world
            size of 1 no collective is issued at all.
    """

    def __init__(self, plan: HaloPlan, group: Any = None) -> None:
        self.plan = plan
        self.group = group
        self.stats = CommStats()
        # Exact cache for tensors that do not change between calls (layer-0 input
        # features): keyed on object identity + version counter, never on data_ptr, which a
        # later tensor may reuse.
        self._static: dict[int, tuple[weakref.ref, int, Tensor]] = {}
        self._distributed = plan.world_size > 1 and dist.is_available() and dist.is_initialized()

    # -- transport ------------------------------------------------------------------------
    def _all_to_all(self, send: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        out = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
        if not self._distributed:
            return out  # world size 1: nothing to receive
        start = time.perf_counter()
        dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=self.group)
        self.stats.wait_time += time.perf_counter() - start
        row_bytes = send.element_size() * math.prod(send.shape[1:])
        self.stats.bytes_sent += row_bytes * sum(send_counts)
        self.stats.bytes_recv += row_bytes * sum(recv_counts)
        self.stats.exchanges += 1
        return out

    def fetch(self, x: Tensor) -> Tensor:
        """Halo rows of ``x`` (no autograd): ``[N_r, *] -> [H_r, *]``."""
        plan = self.plan
        if x.size(0) != plan.num_owned:
            raise ValueError(
                f"halo exchange expects the {plan.num_owned} rows this rank owns, got {x.size(0)} rows"
            )
        send = x.index_select(0, plan.send_index)
        return self._all_to_all(send, plan.send_counts, plan.recv_counts)

    def push_back(self, grad_halo: Tensor) -> Tensor:
        """Sends halo-row gradients home and sums them at the owners: ``[H_r, *] -> [N_r, *]``."""
        plan = self.plan
        recv = self._all_to_all(grad_halo, plan.recv_counts, plan.send_counts)
        grad = grad_halo.new_zeros((plan.num_owned,) + tuple(grad_halo.shape[1:]))
        return grad.index_add_(0, plan.send_index, recv)

    # -- autograd entry point -------------------------------------------------------------
    def exchange(self, x: Tensor) -> Tensor:
        """Returns ``cat(x, halo(x))`` of shape ``[N_r + H_r, *]``, differentiable in ``x``.

        Tensors that do not require grad and are the very same object (same version) as in
        an earlier call reuse that call's halo rows: layer-0 features cross the wire once.
        """
        if x.requires_grad and torch.is_grad_enabled():
            halo = _HaloExchangeFn.apply(x, self)
            self.stats.forward_exchanges += 1
        else:
            halo = self._fetch_static(x)
        return torch.cat([x, halo], dim=0)

    def _fetch_static(self, x: Tensor) -> Tensor:
        entry = self._static.get(id(x))
        if entry is not None and entry[0]() is x and entry[1] == x._version:
            self.stats.cache_hits += 1
            return entry[2]
        halo = self.fetch(x.detach())
        self.stats.forward_exchanges += 1
        # Keep only live entries; a tensor that died can never be hit again.
        self._static = {k: v for k, v in self._static.items() if v[0]() is not None}
        try:
            self._static[id(x)] = (weakref.ref(x), x._version, halo)
        except TypeError:  # pragma: no cover - tensors are weak-referenceable
            pass
        return halo

    def clear_cache(self) -> None:
        self._static.clear()


class _HaloExchangeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, exchanger: HaloExchanger) -> Tensor:
        ctx.exchanger = exchanger
        return exchanger.fetch(x.detach())

    @staticmethod
    def backward(ctx: Any, grad_halo: Tensor) -> tuple[Tensor, None]:
        exchanger: HaloExchanger = ctx.exchanger
        exchanger.stats.backward_exchanges += 1
        return exchanger.push_back(grad_halo.contiguous()), None
