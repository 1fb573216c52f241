"""A rank's local graph and a fake exchanger for the single-process adapter tests.

Single process: a fake exchanger stands in for the other ranks (fixed halo rows, fixed halo
degrees for GCN's global normalisation) and records what every exchange was given.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing

from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.patch import install_adapters

F_IN = 3

# A rank's local graph: owned nodes 0..3, halo rows 0, 1 = local ids 4, 5.
#   4 -> 0, 4 -> 1, 5 -> 1, 1 -> 0, 2 -> 1, 4 -> 2, 0 -> 3
# in-degrees (no self-loops): node 0: 2, node 1: 3, node 2: 1, node 3: 1 (node 3 is central).
EDGES = torch.tensor([[4, 4, 5, 1, 2, 4, 0], [0, 1, 1, 0, 1, 2, 3]])
WEIGHTS = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5, 0.25, 0.7])
NUM_OWNED, NUM_HALO = 4, 2
# Global GCN degrees of the halo nodes (self-loop included), known only to their owners.
HALO_DEGREE = torch.tensor([2.0, 5.0])


class _Pending:
    def __init__(self, halo: Tensor) -> None:
        self.halo = halo

    def wait(self) -> Tensor:
        return self.halo


class FakeExchanger:
    """The other ranks: halo feature rows are fixed random rows, degree rows ``HALO_DEGREE``."""

    def __init__(self) -> None:
        self.plan = SimpleNamespace(num_owned=NUM_OWNED, num_halo=NUM_HALO, rank=0, world_size=2)
        self.calls: list[tuple[bool, Any]] = []
        self.halo_x = torch.randn(NUM_HALO, 64, generator=torch.Generator().manual_seed(1))

    def _halo(self, x: Tensor, exact: bool) -> Tensor:
        if exact:
            return HALO_DEGREE.to(x.dtype).view(-1, 1)
        return self.halo_x[:, : x.size(1)].to(x.dtype)

    def is_static(self, x: Tensor) -> bool:
        # The fixed halo rows stand for remote rows of a layer INPUT: a projection of them
        # (HaloContext.sends_projection) cannot be faked, so every input travels as itself.
        return True

    def exchange(self, x: Tensor, exact: bool = False, score: Any = None, source: Any = None) -> Tensor:
        self.calls.append((exact, score))
        return torch.cat([x, self._halo(x, exact)], dim=0)

    def halo(self, x: Tensor, exact: bool = False, score: Any = None) -> Tensor:
        self.calls.append((exact, score))
        return self._halo(x, exact)

    def exchange_async(self, x: Tensor, exact: bool = False, score: Any = None, source: Any = None) -> _Pending:
        self.calls.append((exact, score))
        return _Pending(self._halo(x, exact))

    def scores(self) -> list[Any]:
        return [score for exact, score in self.calls if not exact]


def mlp() -> nn.Module:
    """A small MLP for GIN / GINE."""
    return nn.Sequential(nn.Linear(F_IN, 4), nn.ReLU(), nn.Linear(4, 4))


def run_conv(conv: MessagePassing, weighted: bool = False, edges: Tensor = EDGES, overlap: bool = False,
         edge_attr: Tensor | None = None):
    """Installs the adapters on ``conv`` over a :class:`FakeExchanger` and calls it once:
    ``(exchanger, ctx, handle, out)``."""
    exchanger = FakeExchanger()
    ctx = HaloContext(exchanger, overlap=overlap)
    handle = install_adapters(nn.ModuleList([conv]), ctx)
    x = torch.randn(NUM_OWNED, F_IN, generator=torch.Generator().manual_seed(0))
    if weighted:
        out = conv(x, edges, WEIGHTS)
    elif edge_attr is not None:
        out = conv(x, edges, edge_attr)
    else:
        out = conv(x, edges)
    return exchanger, ctx, handle, out
