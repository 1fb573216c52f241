"""Sparse aggregation time of one rank's part in each row order, side by side.

The partition plan numbers a rank's owned rows block by block (METIS recursive bisection
into blocks of ``ORDER_BLOCK_ROWS`` rows) and its halo rows in first-touch order
(``PartitionPlanner(node_order="locality")``, the default), instead of in reverse
Cuthill-McKee order (``node_order="rcm"``, the default of partition format 2) or by ascending
global id (``node_order="global"``).  This script builds the three plans from the
SAME METIS assignment of a generated products-like graph and times, on the largest part, what
every GCN/SAGE layer runs: the product of the cached CSR adjacency ``[N_r, N_r + H_r]`` with
the features (forward) and of its transpose with the gradient (backward), through the
package's own ``csr_adjacency`` / ``csr_transpose`` / ``csr_mm``, one thread, ``--features`` columns.  It also prints what the ordering
costs in the planner::

    python benchmarks/bench_locality.py --nodes 1000000
    python benchmarks/bench_locality.py --nodes 100000 --json out.json

No training and no wall-time assertion: a measurement to read, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--metis-fraction", type=float, default=0.25, help="as `run.py --scale`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    import torch

    from lightning_fullgraph.data.datasets import products_like_graph
    from lightning_fullgraph.nn.sparse import csr_adjacency, csr_mm, csr_transpose
    from lightning_fullgraph.partition.partitioner import partition_graph
    from lightning_fullgraph.partition.planner import NODE_ORDERS, PartitionPlanner

    torch.set_num_threads(1)
    t = time.perf_counter()
    data = products_like_graph(num_nodes=args.nodes, seed=args.seed)
    num_edges = int(data.edge_index.size(1))
    print(f"{args.nodes:,} nodes, {num_edges:,} edges generated in {time.perf_counter() - t:.1f} s", flush=True)
    bound = round(args.metis_fraction * num_edges / 2) if args.metis_fraction > 0 else None
    parts = partition_graph(
        data.edge_index, args.nodes, args.parts, seed=args.seed, **({"metis_max_edges": bound} if bound else {})
    )
    rank = int(torch.bincount(parts[data.edge_index[1]], minlength=args.parts).argmax())
    g = torch.Generator().manual_seed(args.seed)
    results: dict[str, dict[str, float]] = {}
    for order in reversed(NODE_ORDERS):  # "global" first: the baseline
        t = time.perf_counter()
        planner = PartitionPlanner(data, parts, args.parts, node_order=order)
        plan_s = time.perf_counter() - t
        part = planner.part(rank)
        del planner
        n, h = part.plan.num_owned, part.plan.num_halo
        adj = csr_adjacency(part.data.edge_index, None, n, n + h, torch.float32)
        adj_t = csr_transpose(adj)
        x = torch.randn(n + h, args.features, generator=g)
        grad = torch.randn(n, args.features, generator=g)
        fwd, bwd = [], []
        csr_mm(adj, x), csr_mm(adj_t, grad)  # warm-up
        for _ in range(args.repeats):
            t = time.perf_counter()
            csr_mm(adj, x)
            fwd.append(time.perf_counter() - t)
            t = time.perf_counter()
            csr_mm(adj_t, grad)
            bwd.append(time.perf_counter() - t)
        e = int(part.data.edge_index.size(1))
        results[order] = {
            "plan_seconds": plan_s,
            "forward_seconds": statistics.median(fwd),
            "backward_seconds": statistics.median(bwd),
            "forward_ns_per_edge": statistics.median(fwd) / e * 1e9,
            "owned": n,
            "halo": h,
            "edges": e,
        }
        print(
            f"{order:>8}: part {rank} ({n:,} owned + {h:,} halo rows, {e:,} edges): csr_mm forward "
            f"{statistics.median(fwd):.3f} s ({results[order]['forward_ns_per_edge']:.1f} ns/edge), transpose "
            f"{statistics.median(bwd):.3f} s; planner {plan_s:.1f} s",
            flush=True,
        )
    loc = results["locality"]
    for other in ("global", "rcm"):
        base = results[other]
        print(
            f"locality / {other}: forward {loc['forward_seconds'] / base['forward_seconds']:.2f}x, "
            f"transpose {loc['backward_seconds'] / base['backward_seconds']:.2f}x the time; planner "
            f"{loc['plan_seconds'] - base['plan_seconds']:+.1f} s (median of {args.repeats}, 1 thread, "
            f"{args.features} features, load {os.getloadavg()[0]:.1f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "part": rank, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
