"""What the central/marginal overlap split costs and what it can hide, per rank (issue 31).

For each ``graph:parts``: METIS partition (seed 0, as ``run.py``), then for every rank a GCN
3 x ``--hidden`` through the package's adapters with a stand-in exchanger whose halo rows
(zeros) arrive at once -- the compute-only view, no transfer.  Printed side by side per rank:

* ``share``: the central share of the aggregation (:func:`lightning_fullgraph.nn.overlap.central_inputs`);
* ``off`` / ``on``: forward+backward of the stack without and with the split (median of
  ``--repeats`` alternating steps after a warm-up pair), and ``cost = on - off``;
* ``hideable``: the work the split runs between launching a transfer and waiting for it
  (forward: ``exchange_async`` to ``wait``; backward: the gradient's launch to its wait), the
  most it can hide.  The split pays only where ``hideable > cost``, by at most the difference.

``--timer cpu`` (default) measures the thread's CPU time, steadier when other processes share
the cores; ``--timer wall`` measures wall time.  The threshold of
:data:`lightning_fullgraph.nn.overlap.MIN_CENTRAL_SHARE` comes from this script::

    python benchmarks/overlap_cost.py tolokers:4 cora:4 grid200:4 community20k-d8:2 \\
        community20k-d8:4 products-like100k:2 products-like100k:4 community60k-d40:4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(1, str(BENCH_DIR.parent))  # run from a checkout

from common import SHARED  # noqa: E402
from torch_geometric.data import Data  # noqa: E402
from torch_geometric.nn import GCNConv  # noqa: E402

from lightning_fullgraph.data.datasets import community_graph, load_dataset, products_like_graph  # noqa: E402
from lightning_fullgraph.nn.context import HaloContext  # noqa: E402
from lightning_fullgraph.nn.overlap import central_inputs  # noqa: E402
from lightning_fullgraph.nn.patch import install_adapters  # noqa: E402
from lightning_fullgraph.partition.partitioner import partition_graph  # noqa: E402
from lightning_fullgraph.partition.planner import build_local_partitions  # noqa: E402

CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}


def grid(n: int) -> Data:
    """An ``n x n`` grid, both directions: almost every row is central at a few parts."""
    idx = torch.arange(n * n).view(n, n)
    ei = torch.cat([torch.stack([idx[:, :-1].flatten(), idx[:, 1:].flatten()]),
                    torch.stack([idx[:-1].flatten(), idx[1:].flatten()])], 1)
    ei = torch.cat([ei, ei.flip(0)], 1)
    return Data(x=torch.randn(n * n, 32), edge_index=ei, num_nodes=n * n)


GRAPHS = {
    "tolokers": lambda: load_dataset("tolokers", root=SHARED / "Heterophilous"),
    "cora": lambda: load_dataset("Cora", root=SHARED / "Planetoid"),
    "community20k-d8": lambda: community_graph(num_nodes=20000, avg_degree=8, seed=0),
    "community60k-d40": lambda: community_graph(num_nodes=60000, avg_degree=40, seed=0),
    "products-like100k": lambda: products_like_graph(num_nodes=100000, seed=0),
    "grid200": lambda: grid(200),
}


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: StandIn, state: dict) -> torch.Tensor:
        ctx.ex, ctx.state, ctx.shape = ex, state, x.shape
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        ctx.ex.hidden += ctx.ex.clock() - ctx.state["back"]  # the gradient's wait
        return g.new_zeros(ctx.shape), None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, state: dict, halo: torch.Tensor) -> torch.Tensor:
        ctx.state = state
        return halo

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        ctx.state["back"] = CLOCK_NOW[0]()  # the gradient's launch
        return g.new_empty(0), None, None


CLOCK_NOW = [time.thread_time]


class StandIn:
    """The other ranks: zero halo rows (degree rows: ones), at once."""

    def __init__(self, num_owned: int, num_halo: int, clock: Any) -> None:
        self.plan = SimpleNamespace(num_owned=num_owned, num_halo=num_halo, rank=0, world_size=2)
        self.clock, self.hidden = clock, 0.0

    def _rows(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        shape = (self.plan.num_halo,) + tuple(x.shape[1:])
        return torch.ones(shape, dtype=x.dtype) if exact else x.new_zeros(shape)

    def exchange(self, x: torch.Tensor, exact: bool = False, score: Any = None) -> torch.Tensor:
        return torch.cat([x, self._rows(x, exact)])

    def halo(self, x: torch.Tensor, exact: bool = False, score: Any = None) -> torch.Tensor:
        return self._rows(x, exact)

    def exchange_async(self, x: torch.Tensor, exact: bool = False, score: Any = None) -> Any:
        state = {"start": self.clock()}
        token = _Start.apply(x, self, state)

        def wait() -> torch.Tensor:
            self.hidden += self.clock() - state["start"]
            return _Wait.apply(token, state, self._rows(x, exact))

        return SimpleNamespace(wait=wait)


class GCN(nn.Module):
    def __init__(self, f_in: int, hidden: int, out: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList([GCNConv(f_in, hidden), GCNConv(hidden, hidden), GCNConv(hidden, out)])

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, ei)
            x = x.relu() if i < len(self.convs) - 1 else x
        return x


def measure(part: Any, f_in: int, hidden: int, repeats: int, clock: Any) -> tuple[float, float, float]:
    """``(off, on, hideable)`` seconds: medians over ``repeats`` alternating steps."""
    n, h = part.plan.num_owned, part.plan.num_halo
    x, ei = torch.randn(n, f_in), part.data.edge_index
    torch.manual_seed(0)
    net = GCN(f_in, hidden, 2)
    ctxs = {on: HaloContext(StandIn(n, h, clock), overlap=on) for on in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    hidden_s: list[float] = []
    for r in range(repeats + 1):
        for on in (False, True) if r % 2 == 0 else (True, False):
            handle = install_adapters(net, ctxs[on])
            ctxs[on].exchanger.hidden = 0.0
            net.zero_grad(set_to_none=True)
            t = clock()
            net(x, ei).sum().backward()
            dt = clock() - t
            handle.remove()
            if r > 0:  # the first pair builds the caches
                times[on].append(dt)
                if on:
                    hidden_s.append(ctxs[on].exchanger.hidden)
    return statistics.median(times[False]), statistics.median(times[True]), statistics.median(hidden_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="+", help=f"graph:parts, graph one of {', '.join(GRAPHS)}")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timer", choices=tuple(CLOCK), default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = CLOCK[args.timer]
    CLOCK_NOW[0] = clock
    print(f"GCN 3 x {args.hidden}, {args.threads} thread(s), {args.timer} time, median of {args.repeats} steps")
    print("graph parts rank owned halo edges share off_ms on_ms cost_ms hideable_ms")
    for spec in args.specs:
        name, k = spec.split(":")
        data = GRAPHS[name]()
        parts = partition_graph(data.edge_index, data.num_nodes, int(k), seed=0)
        for r, part in enumerate(build_local_partitions(data, parts, int(k))):
            central, total = central_inputs(part.data.edge_index, part.plan.num_owned, part.plan.marginal_mask)
            off, on, hide = measure(part, data.x.size(1), args.hidden, args.repeats, clock)
            print(f"{name} {k} {r} {part.plan.num_owned} {part.plan.num_halo} {part.data.edge_index.size(1)} "
                  f"{central / total:.3f} {off * 1e3:.1f} {on * 1e3:.1f} {(on - off) * 1e3:+.1f} {hide * 1e3:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
