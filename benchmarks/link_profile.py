r"""AdaQP's link profile, twice on the same links: fitted costs and the bits they lead to, side by side.

On ``--ranks`` forked gloo ranks over loopback (identical links), the community graph is
partitioned and every link is profiled the way the policy does at its first assignment
(:func:`~lightning_fullgraph.comm.policies.adaqp.distributed.profile_links` over each link's
real message range, for a GCN of ``--layers`` x ``--hidden``), twice, and with the former
rule (4 sizes 1 KiB .. 1 MiB x 3 repeats, the same size both ways, per-link non-negative least
squares, no checks), twice.  Rank 0 then solves ONE fixed assignment problem (every pair's
rows from the plan; per-row variance coefficients drawn once, log-normal, seeded) for every
(layer, direction) with each profile and with ``link_costs="uniform"``, and prints the mean
assigned bits and each link's fitted costs side by side, and each profile's time.

``python benchmarks/link_profile.py`` (about 30 s on 2 cores); ``--profiles 16x5,8x3`` compares
the former profile (16 sizes x 5 repeats) with the policy's (8 x 3), each twice; behind an emulated link:
``unshare -n bash -c "ip link set lo up; tc qdisc add dev lo root tbf rate 1gbit burst 1mbit
latency 50ms; python benchmarks/link_profile.py"``.  Nothing is asserted: the
test of the behaviour is ``tests/distributed/test_adaptive.py``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--nodes", type=int, default=20000)
    p.add_argument("--degree", type=float, default=16.0)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--group-size", type=int, default=100)
    p.add_argument("--profiles", default="8x3",
                   help="comma-separated SIZESxREPEATS of the policy's profile to compare, each run twice "
                   "(default: the policy's, 8x3; it was 16x5)")
    p.add_argument("--no-former", action="store_true", help="skip the former rule (4 sizes x 3 repeats)")
    return p.parse_args(argv)


def legacy_costs(rank: int, world_size: int) -> dict:
    """The former ``measure_link_costs``: 4 sizes x 3 repeats, sender-timed, NNLS, no checks."""
    import torch
    import torch.distributed as dist

    from lightning_fullgraph.comm.policies.adaqp.links import fit_alpha_beta

    mine = {}
    for r in range(1, world_size):
        to, frm = (rank + r) % world_size, (rank - r) % world_size
        xs, ts = [], []
        for k, size in enumerate((1 << 10, 1 << 14, 1 << 17, 1 << 20)):
            send, recv = torch.zeros(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
            for rep in range(4 if k == 0 else 3):
                dist.barrier()
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                if k == 0 and rep == 0:
                    continue  # warm-up
                xs.append(float(size))
                ts.append(time.perf_counter() - start)
        cost = fit_alpha_beta(xs, ts)
        mine[(rank, to)] = cost
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {pair: c for table in gathered for pair, c in table.items()}


def _qdisc() -> str:
    """The loopback's queueing discipline (a ``tc tbf`` throttle when run behind ``unshare -n``)."""
    import subprocess

    try:
        out = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "qdisc unknown"
    return " ".join(out.split()) or "qdisc unknown"


def worker(rank: int, world_size: int, a: argparse.Namespace) -> None:
    import warnings

    import numpy as np
    import torch
    import torch.distributed as dist

    from lightning_fullgraph.comm.policies.adaqp.distributed import profile_links
    from lightning_fullgraph.comm.policies.adaqp.links import NOMINAL_COST, message_range
    from lightning_fullgraph.comm.policies.adaqp.milp import ADAPTIVE_BITS, assign_bits, build_problem
    from lightning_fullgraph.comm.quantize import META_NBYTES
    from lightning_fullgraph.data.datasets import community_graph
    from lightning_fullgraph.partition.partitioner import partition_graph
    from lightning_fullgraph.partition.planner import build_local_partitions

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    g = community_graph(num_nodes=a.nodes, avg_degree=a.degree, num_features=a.features, seed=0)
    parts = partition_graph(g.edge_index, g.num_nodes, world_size)
    local = build_local_partitions(g, parts, world_size)
    dims = {(0, "forward"): a.features}
    for layer in range(1, a.layers):
        dims[(layer, "forward")] = dims[(layer, "backward")] = a.hidden

    def span_of(r: int) -> list:
        return message_range({k: local[r].plan.counts(k[1])[0] for k in dims}, dims, ADAPTIVE_BITS, float(META_NBYTES))

    runs, times = {}, {}
    configs = [tuple(int(v) for v in c.split("x")) for c in a.profiles.split(",")]
    profiled = [f"profile {n}x{r} {i}" for n, r in configs for i in (1, 2)]
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", UserWarning)
        for name in profiled:
            num_sizes, repeats = (int(v) for v in name.split()[1].split("x"))
            links, figures = profile_links(None, rank, world_size, torch.device("cpu"), span_of(rank),
                                           num_sizes=num_sizes, repeats=repeats)
            runs[name], times[name] = links, figures["profile_time"]
    former = [] if a.no_former else ["former 1", "former 2"]
    for name in former:
        start = time.perf_counter()
        runs[name], times[name] = legacy_costs(rank, world_size), time.perf_counter() - start
    if rank != 0:
        dist.destroy_process_group()
        return

    pairs = [(s, p) for s in range(world_size) for p in range(world_size) if s != p]
    rng = np.random.default_rng(0)

    def costs_of(name: str) -> dict:
        got = runs[name]
        return got if isinstance(got, dict) else got.costs

    problems = []
    for key in sorted(dims):
        rows = {(s, p): local[s].plan.counts(key[1])[0][p] for s, p in pairs}
        wv = {pair: torch.from_numpy(rng.lognormal(0.0, 1.0, n)) for pair, n in rows.items() if n}
        problems.append((key, wv))

    def mean_bits(costs: dict) -> float:
        bits = rows = 0.0
        for key, wv in problems:
            problem, _ = build_problem(wv, a.group_size, costs, world_size, dims[key])
            res = assign_bits(problem)
            n = float(problem.rows.sum())
            bits, rows = bits + res.average_bits * n, rows + n
        return bits / rows

    names = profiled + former
    lo_hi = {(s, p): span_of(s)[p] for s, p in pairs}
    print(f"# link profile, {world_size} ranks, community {a.nodes} nodes, GCN {a.layers} x {a.hidden} "
          f"(input {a.features}), loopback ({_qdisc()}); load average {os.getloadavg()[0]:.2f}\n")
    print("| costs | mean bits | profile s |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {mean_bits(costs_of(name)):.2f} | {times[name]:.2f} |")
    print(f"| uniform | {mean_bits({p: NOMINAL_COST for p in pairs}):.2f} | 0 |\n")
    print("| link | message range KB | " + " | ".join(f"{n}: alpha ns/B, beta us" for n in names) + " | profiles' source |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for pair in pairs:
        cells = []
        for name in names:
            c = costs_of(name)[pair]
            cells.append(f"{c.alpha * 1e9:.3f}, {c.beta * 1e6:.0f}")
        lo, hi = lo_hi[pair]
        src = "/".join(runs[name].source[pair] for name in profiled)
        print(f"| {pair[0]}->{pair[1]} | {lo / 1e3:.0f}-{hi / 1e3:.0f} | " + " | ".join(cells) + f" | {src} |")
    for name in profiled:
        fit = runs[name].pooled
        print(f"\n{name}: pooled fit alpha {fit.cost.alpha * 1e9:.3f} ns/B, beta {fit.cost.beta * 1e6:.0f} us, "
              f"R^2 {fit.r2:.2f}, {'accepted' if fit.accepted else 'rejected: ' + fit.reason}")
    for note in sorted({str(n.message) for n in notes}):
        print(f"note: {note}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    a = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.start_processes(worker, args=(a.ranks, a), nprocs=a.ranks, start_method="fork")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
