"""Throughput, traffic, memory and accuracy of every mode, side by side, on emulated links.

One invocation runs the modes ``exact``, ``adaqp`` and ``sylvie`` and each one's own bound
(``exact-bound``, ``adaqp-bound``, ``sylvie-bound``: ``FullGraphStrategy(mode=M,
compute_only=True)``, mode M's compute path with every halo transfer skipped; ``compute-only``
is the old name of ``exact-bound``) on the same graph, model and partitions at every rank
count, a single-process PyG peer on the whole graph, plus a scaling sweep (exact mode, ranks x
graph sizes) and optional accuracy runs, and writes ``<out>/<name>.json``, ``<out>/<name>.md``
and ``<out>/<name>.png``::

    python benchmarks/run.py --quick                   # < 5 min on 2 cores
    python benchmarks/run.py --full                    # the issue's goal configuration (1 Gbit/s)
    python benchmarks/run.py --commbound               # link rate calibrated: exact 75 % communication
    python benchmarks/run.py --graph tolokers --ranks 4 --link 1gbit --name tolokers-1g
    python benchmarks/run.py --graph community --nodes 300000 --ranks 2,4 --link 10gbit
    python benchmarks/run.py --render benchmarks/results/quick.json   # redraw .md/.png only
    python benchmarks/run.py --convergence --graphs lowloc,cora --link 1gbit   # time to accuracy

Every configuration runs in a fresh ``python benchmarks/run.py --worker SPEC`` process that
launches the Lightning Trainer (CPU, gloo, ``start_method="fork"``, one thread per rank).  With
``--link 1gbit|10gbit|calibrated`` that process runs in a fresh network namespace (``unshare
-n``) whose loopback, the only interface there, is throttled by a token bucket (``tc ... tbf``):
all halo traffic, gradient all-reduces and rendezvous go through it.  ``--link calibrated``
first measures ``exact-bound`` unthrottled and chooses the rate at which exact spends
``--target-comm`` (75 %) of its epoch communicating.  See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # run from a checkout: `python benchmarks/run.py`
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))  # bench_modes, bench_report, bench_worker, peer

from bench_modes import DEFAULT_MODES, all_names, canonical, is_bound, is_known  # noqa: E402
from common import (  # noqa: E402
    MALLOC_ENVS,
    SHARED,
    check_link_support,
    config,
    link_wrapper,
    lowloc_graph,
    parse_rate,
    part_key,
    run_config,
    run_logged,
    settle_assign_schedule,
)

MODES = DEFAULT_MODES
SCOPES = ("shared", "per-rank")
BALANCES = ("edges", "nodes")

PRESETS: dict[str, dict[str, Any]] = {
    # small graph, every mode and its bound at 2 and 4 ranks on a 1 Gbit/s link, the peer, a
    # scaling sweep on two small sizes, Cora accuracy at 4 ranks: < 5 minutes on 2 cores
    "quick": dict(
        graph="community", nodes=20_000, hidden=128, ranks="2,4", link="1gbit", warmup=3, epochs=4,
        scaling_nodes="5000,20000", scaling_ranks="1,2,4", scaling_epochs=3, accuracy="cora",
        accuracy_ranks="4", accuracy_epochs=60,
    ),
    # the goal: 1 Gbit/s, 4 ranks, hidden 256, tolokers; two rounds in alternating order
    "full": dict(
        graph="tolokers", hidden=256, ranks="4", link="1gbit", warmup=3, epochs=5, repeat=2,
        scaling_nodes="", accuracy="",
    ),
    # the communication-bound regime of the papers: the link rate is chosen so that exact spends
    # 75 % of its epoch on communication; both link scopes
    "commbound": dict(
        graph="tolokers", hidden=256, ranks="4", link="calibrated", link_scope="shared,per-rank", warmup=3,
        epochs=5, scaling_nodes="", accuracy="",
    ),
    # test accuracy of every mode on Cora (hidden 256, 100 epochs) at 2 and 4 ranks
    "accuracy": dict(
        ranks="", hidden=256, link="none", scaling_nodes="", accuracy="cora", accuracy_ranks="2,4",
        accuracy_epochs=100,
    ),
    # per-rank memory and epoch time vs ranks and graph size (exact mode only)
    "scaling": dict(
        ranks="", hidden=256, link="1gbit", scaling_nodes="10000,30000,100000", scaling_ranks="1,2,4",
        scaling_epochs=3, accuracy="",
    ),
}
DEFAULTS = dict(
    graph="community", nodes=100_000, hidden=256, ranks="2,4", link="1gbit", link_scope="shared", warmup=5,
    epochs=5, scaling_nodes="", scaling_ranks="1,2,4", scaling_epochs=4, accuracy="", accuracy_ranks="2,4",
    accuracy_epochs=100, repeat=1,
)


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="small preset, < 5 minutes on 2 cores")
    preset.add_argument("--full", action="store_true",
                        help="the issue's goal configuration (1 Gbit/s, 4 ranks, hidden 256, tolokers)")
    preset.add_argument("--commbound", action="store_true",
                        help="tolokers, hidden 256, 4 ranks, link rate calibrated so that exact spends 75%% of its "
                        "epoch communicating (--link calibrated), shared and per-rank link scopes")
    preset.add_argument("--accuracy-preset", action="store_true", dest="accuracy_preset",
                        help="test accuracy of exact/adaqp/sylvie on Cora, hidden 256, 100 epochs, 2 and 4 ranks")
    preset.add_argument("--scaling", action="store_true",
                        help="scaling sweep only: community 10^4/3*10^4/10^5 nodes at 1, 2, 4 ranks (exact)")
    preset.add_argument("--scale", action="store_true",
                        help="products-scale sweep: the products-like graph at 10^5 / 3*10^5 / 10^6 / 2.45*10^6 "
                        "nodes, partition time and memory, 4 ranks x exact/adaqp/sylvie x gcn/sage, fitted exponents "
                        "(its own options: run.py --scale --help; see bench_scale.py)")
    p.add_argument("--name", help="results file stem (default: the preset's name, else 'bench')")
    p.add_argument("--out-dir", default=str(BENCH_DIR / "results"), help="where <name>.json/.md/.png go")
    p.add_argument("--graph", choices=("community", "products-like", "tolokers", "cora", "lowloc"),
                   help="graph of the main comparison")
    p.add_argument("--nodes", type=int, help="nodes of the generated community or products-like graph, 10^4 .. "
                   "2449029 (default 10^5)")
    p.add_argument("--avg-degree", type=float, default=8.0,
                   help="mean degree of the generated community graph (default 8; the issue-10 table: 40)")
    p.add_argument("--conv", choices=("gcn", "sage"), default="gcn")
    p.add_argument("--hidden", type=int, help="hidden width (default 256; --quick: 128)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--ranks", help="comma-separated rank counts of the main comparison (default 2,4; '' = none)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated modes (default: every mode and its own bound, {','.join(MODES)}); any of "
                   f"{','.join(all_names())}; compute-only = exact-bound")
    p.add_argument("--link", choices=("1gbit", "10gbit", "calibrated", "none"),
                   help="emulated link (default 1gbit); calibrated: the rate at which exact spends --target-comm of "
                   "its epoch communicating, measured first in the same invocation (see README)")
    p.add_argument(
        "--link-scope",
        help="comma-separated, each runs the main comparison: shared (default): ONE token bucket of the link's "
        "rate for all ranks together (every byte of every rank crosses the same throttled loopback); "
        "per-rank: the bucket's rate is the link rate x ranks, what a switch with one full-duplex link per "
        "rank gives balanced all-to-all traffic",
    )
    p.add_argument("--link-rate", help="--link calibrated: use this per-link rate (e.g. 200mbit, 2e8 = bit/s) "
                   "instead of calibrating")
    p.add_argument("--target-comm", type=float, default=0.75,
                   help="--link calibrated: the fraction of exact's epoch spent communicating (default 0.75)")
    p.add_argument("--target-band", type=float, default=0.02,
                   help="--link calibrated: the probe's measured fraction may miss the target by this much before "
                   "the rate is rescaled once (default 0.02: 73-77%%, inside the papers' 70-80%% regime)")
    p.add_argument("--calibration-epochs", type=int, default=2,
                   help="measured epochs of the calibration runs (exact-bound unthrottled, exact probe)")
    p.add_argument("--fallback-none", action="store_true",
                   help="if unshare/tc are unavailable, run unthrottled (loudly flagged in the report) instead of failing")
    p.add_argument("--balance",
                   help="comma-separated, what METIS balances: edges and/or nodes (default: the partitioner's "
                   "default). The first runs every mode; each further one runs exact and exact-bound only "
                   "(a before/after of the halo wait in one invocation)")
    p.add_argument("--no-peer", action="store_true",
                   help="skip the single-process PyG peer on the whole graph (edge_index and sparse CSR inputs)")
    p.add_argument("--peer-threads",
                   help="comma-separated torch thread counts of the peer (default: the cores available, and 1)")
    p.add_argument("--bound-tolerance", type=float, default=0.05,
                   help="flag a mode whose median epoch beats its own bound's by more than this fraction")
    p.add_argument("--warmup", type=int, help="warm-up epochs, not measured (default 5)")
    p.add_argument("--epochs", type=int, help="measured epochs after the warm-up (default 5)")
    p.add_argument("--staleness", type=int, default=5, help="sylvie: every staleness-th epoch is synchronous")
    p.add_argument("--assign-every", type=int,
                   help="adaqp: epochs between bit-width assignments (default: the warm-up, so the first "
                   "assignment is the first measured epoch)")
    p.add_argument("--first-assign", type=int,
                   help="adaqp: epoch of the first bit-width assignment (default: --assign-every). With "
                   "--first-assign 1 --assign-every 50 the assignment falls in the warm-up and the measured epochs "
                   "are a user's steady epochs at the assigned widths (the default schedule re-assigns every 50)")
    p.add_argument("--link-costs", choices=("measure", "uniform"), default="measure", help="adaqp link-cost source")
    p.add_argument("--scaling-nodes", help="comma-separated community sizes of the scaling sweep ('' = none)")
    p.add_argument("--scaling-ranks", help="rank counts of the scaling sweep (default 1,2,4)")
    p.add_argument("--scaling-epochs", type=int, help="measured epochs (after a 1-epoch warm-up) per scaling run")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling sweep")
    p.add_argument("--accuracy", choices=("", "cora", "community", "tolokers"),
                   help="also run every mode for --accuracy-epochs on this graph and report test accuracy")
    p.add_argument("--accuracy-ranks", help="rank counts of the accuracy runs")
    p.add_argument("--accuracy-epochs", type=int)
    p.add_argument(
        "--malloc", choices=tuple(MALLOC_ENVS), default="default",
        help="the ranks' allocator environment: no-mmap: MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge> (glibc), so "
        "that big tensors are recycled from the heap instead of being mmap-ed and page-faulted in afresh at every "
        "allocation (on CPU that is up to half of the compute time, see README); thp: THP_MEM_ALLOC_ENABLE=1 (torch "
        "madvises allocations of 2 MiB and more for transparent huge pages: one fault per 2 MiB instead of per 4 KiB) "
        "and MALLOC_MMAP_THRESHOLD_=2097152 (such allocations are mmap-ed, so a freed one returns to the kernel "
        "instead of fragmenting the heap)",
    )
    p.add_argument("--repeat", type=int,
                   help="rounds of the mode comparison (alternating order); measured epochs are pooled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before one configuration is killed")
    p.add_argument("--cache-dir", default=str(BENCH_DIR / ".cache"), help="partitions and dataset cache")
    p.add_argument("--keep-going", action="store_true", help="record a failed configuration and continue")
    args = p.parse_args(argv)
    preset_name = next((n for n, flag in (("quick", args.quick), ("full", args.full), ("commbound", args.commbound),
                                          ("scaling", args.scaling), ("accuracy", args.accuracy_preset)) if flag), None)
    values = dict(DEFAULTS, **(PRESETS[preset_name] if preset_name else {}))
    for key, value in values.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.name = args.name or preset_name or "bench"
    args.preset = preset_name
    if args.no_scaling:
        args.scaling_nodes = ""
    # modes: canonical names (compute-only -> exact-bound), in the order given, no duplicates
    args.modes_list = list(dict.fromkeys(canonical(m.strip()) for m in args.modes.split(",") if m.strip()))
    bad = [m for m in args.modes_list if not is_known(m)]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {all_names()} (compute-only = exact-bound)")
    args.scope_list = list(dict.fromkeys(s.strip() for s in str(args.link_scope).split(",") if s.strip()))
    if not args.scope_list or set(args.scope_list) - set(SCOPES):
        p.error(f"--link-scope {args.link_scope!r}: comma-separated subset of {SCOPES}")
    args.balance_list = list(dict.fromkeys(b.strip() for b in (args.balance or "").split(",") if b.strip()))
    if set(args.balance_list) - set(BALANCES):
        p.error(f"--balance {args.balance!r}: comma-separated subset of {BALANCES}")
    if not 0.0 < args.target_comm < 1.0:
        p.error("--target-comm must lie in (0, 1)")
    args.link_rate_bps = parse_rate(args.link_rate) if args.link_rate else None
    if args.link_rate_bps is not None and args.link != "calibrated":
        p.error("--link-rate goes with --link calibrated")
    args.peer_threads_list = _ints(args.peer_threads) if args.peer_threads else peer_thread_counts()
    settle_assign_schedule(p, args)
    return args


def _ints(text: str) -> list[int]:
    return [int(float(t)) for t in str(text).split(",") if t.strip()]


def peer_thread_counts() -> list[int]:
    """The cores this process may run on (what the ranks share), and 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return sorted({cores, 1}, reverse=True)


# -- calibration of the communication-bound link ------------------------------------------------
def allreduce_bytes_per_rank(param_bytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``param_bytes`` of gradients:
    ``2 (ranks - 1) / ranks x param_bytes`` (reduce-scatter + all-gather); 0 for one rank."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * param_bytes


def link_bytes_per_epoch(scope: str, ranks: int, halo_bytes_total: float, halo_bytes_max_rank: float,
                         param_bytes: float) -> float:
    """Bytes per epoch the calibrated link must carry.

    ``shared``: one bucket carries every rank's traffic: the halo bytes of all ranks plus every
    rank's all-reduce share.  ``per-rank``: each rank has its own link of the calibrated rate
    (the bucket gets ``rate x ranks``): the busiest rank's halo bytes plus its all-reduce share."""
    ar = allreduce_bytes_per_rank(param_bytes, ranks)
    if scope == "shared":
        return float(halo_bytes_total) + ranks * ar
    if scope == "per-rank":
        return float(halo_bytes_max_rank) + ar
    raise ValueError(f"scope {scope!r}")


def calibrated_rate(link_bytes: float, compute_s: float, target: float = 0.75) -> float:
    """The link rate (bit/s) at which moving ``link_bytes`` takes ``target`` of an epoch whose
    computation takes ``compute_s`` (communication not overlapped):

        comm = bytes / rate,  comm / (compute_s + comm) = target
        =>  rate = bytes (1 - target) / (target compute_s)        (target 0.75: bytes / (3 compute_s))
    """
    if not 0.0 < target < 1.0:
        raise ValueError(f"target fraction {target} not in (0, 1)")
    if compute_s <= 0 or link_bytes <= 0:
        raise ValueError(f"need positive bytes and compute time, got {link_bytes} B, {compute_s} s")
    return 8.0 * link_bytes * (1.0 - target) / (target * compute_s)


def comm_fraction(epoch_s: float, compute_s: float) -> float:
    """Fraction of an epoch not explained by computation: ``(epoch - compute) / epoch``."""
    return (epoch_s - compute_s) / epoch_s


def rescaled_rate(rate_bps: float, measured_fraction: float, target: float = 0.75) -> float:
    """One re-calibration step.  A probe at ``rate_bps`` measured the fraction ``f`` of its
    epoch ``E`` spent communicating: communication ``f E`` moved ``B = f E rate`` bytes and the
    rest ``(1 - f) E`` is computation.  The rate that makes the same bytes take ``target``::

        rate' = rate x f (1 - target) / (target (1 - f))
    """
    f = min(max(measured_fraction, 0.01), 0.99)
    return rate_bps * f * (1.0 - target) / (target * (1.0 - f))


def halo_bytes_from_partition(halo_rows_total: int, hidden: int, layers: int) -> float:
    """Fallback estimate of exact's halo bytes per epoch (all ranks) when no counter is
    available: fp32 rows of width ``hidden``, forward and backward, for every layer but the
    first (its input features are constant: fetched once, cached)."""
    return 2.0 * max(layers - 1, 1) * hidden * 4 * halo_rows_total


# -- graphs and partitions -----------------------------------------------------------------
# mean degree of the generated community graph (--avg-degree; set once by main)
COMMUNITY_AVG_DEGREE = [8.0]


def load_graph(kind: str, nodes: int, cache_dir: Path, seed: int):
    from lightning_fullgraph.data.datasets import community_graph, load_dataset

    if kind == "community":
        size = f"{nodes / 1e6:g}M" if nodes >= 10**6 else f"{nodes / 1e3:g}k" if nodes >= 1000 else str(nodes)
        deg = COMMUNITY_AVG_DEGREE[0]
        key, label = f"community-{nodes}", f"community {size}"
        if deg != 8.0:
            key, label = f"{key}-d{deg:g}", f"{label}, mean degree {deg:g}"
        return community_graph(num_nodes=nodes, avg_degree=deg, seed=seed), key, label
    if kind == "products-like":
        from lightning_fullgraph.data.datasets import products_like_graph

        size = f"{nodes / 1e6:g}M" if nodes >= 10**6 else f"{nodes / 1e3:g}k"
        return products_like_graph(num_nodes=nodes, seed=seed), f"products-like-{nodes}", f"products-like {size}"
    if kind == "tolokers":
        root = SHARED / "Heterophilous"
        if not root.is_dir():
            raise SystemExit(f"tolokers needs the offline datasets at {root}")
        return load_dataset("tolokers", root=root, cache_dir=cache_dir / "datasets"), "tolokers", "tolokers"
    if kind == "cora":
        root = SHARED / "Planetoid"
        if not root.is_dir():
            raise SystemExit(f"cora needs the offline datasets at {root}")
        return load_dataset("Cora", root=root, cache_dir=cache_dir / "datasets"), "cora", "Cora"
    if kind == "lowloc":  # one fixed graph (its own seed): the convergence study's
        return lowloc_graph(), "lowloc", "low-locality graph (54.6 % halo at 4 parts)"
    raise ValueError(kind)


_LOADED: dict[tuple[str, int], Any] = {}


def supports_balance() -> bool:
    """Whether this version's ``ensure_partitions`` takes ``balance=`` (edges/nodes)."""
    import inspect

    from lightning_fullgraph.partition.cache import ensure_partitions

    return "balance" in inspect.signature(ensure_partitions).parameters


def ensure_parts(data: Any, k: int, balance: str | None, cache_dir: Path, seed: int) -> Any:
    from lightning_fullgraph.partition.cache import ensure_partitions

    kwargs: dict[str, Any] = {}
    if balance:
        if supports_balance():
            kwargs["balance"] = balance
        elif balance != "nodes":  # before balance existed, METIS balanced node counts
            raise SystemExit(f"--balance {balance}: this version's partitioner has no `balance` option")
    return ensure_partitions(data, k, method="metis", seed=seed, cache_root=cache_dir / "partitions", **kwargs)


def partition_info(folder: Path) -> dict[str, Any]:
    """Per-part node/halo/edge counts and their max/mean, from the partition manifest."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    parts = manifest.get("parts", [])
    info: dict[str, Any] = {"balance": manifest.get("balance", "nodes (partitioner without a balance option)")}
    for key, name in (("num_owned", "nodes"), ("num_halo", "halo"), ("num_edges", "edges")):
        vals = [p[key] for p in parts if p.get(key) is not None]
        if vals:
            mean = statistics.fmean(vals)
            info[f"{name}_per_part"] = vals
            info[f"{name}_imbalance"] = max(vals) / mean if mean else None
    for key in ("node_imbalance", "edge_imbalance", "total_halo"):
        if key in manifest:
            info[key] = manifest[key]
    return info


def prepare_graph(kind: str, nodes: int, parts: list[int], cache_dir: Path, seed: int,
                  balances: list[str | None] | None = None) -> dict[str, Any]:
    """Loads the graph once, METIS-partitions it for every rank count and balance (cached)."""
    t0 = time.perf_counter()
    if (kind, nodes) not in _LOADED:
        _LOADED.clear()  # keep at most one graph in memory
        _LOADED[(kind, nodes)] = load_graph(kind, nodes, cache_dir, seed)
    data, key, label = _LOADED[(kind, nodes)]
    info: dict[str, Any] = {
        "key": key, "label": label, "kind": kind, "nodes": int(data.num_nodes), "edges": int(data.edge_index.size(1)),
        "features": int(data.x.size(1)), "classes": int(data.y.max()) + 1, "load_s": time.perf_counter() - t0,
        "partitions": {},
    }
    for balance in balances or [None]:
        for k in sorted(set(parts)):
            result = ensure_parts(data, k, balance, cache_dir, seed)
            info["partitions"][part_key(k, balance)] = {
                "folder": str(result.folder), "rebuilt": result.rebuilt, "seconds": getattr(result, "seconds", None),
                "requested_balance": balance, **partition_info(result.folder),
            }
    return info


def model_param_bytes(args: argparse.Namespace, graph: dict[str, Any]) -> int:
    """fp32 bytes of the model's parameters (= of the gradients every rank all-reduces)."""
    from lightning_fullgraph.models import GNNNodeClassifier

    model = GNNNodeClassifier(conv=args.conv, in_channels=graph["features"], num_classes=graph["classes"],
                              hidden_channels=args.hidden, num_layers=args.layers)
    return int(sum(p.numel() * p.element_size() for p in model.parameters()))


def merge_repeats(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per configuration: repeats pooled (their measured epochs together)."""
    from bench_report import COOLDOWN_EPOCHS, summarize

    merged: dict[tuple, list[dict[str, Any]]] = {}
    for rec in runs:
        merged.setdefault((rec["section"], rec["graph_key"], rec.get("group", ""), rec["mode"], rec["ranks"]),
                          []).append(rec)
    out = []
    for recs in merged.values():
        ok = [r for r in recs if r.get("summary")]
        rec = dict(ok[0] if ok else recs[0])
        if len(recs) > 1:
            rec["repeats"] = len(recs)
            rec["wall_s"] = [r["wall_s"] for r in recs]
            rec["tc"] = [r.get("tc") for r in recs]
            rec["run_dir"] = [r["run_dir"] for r in recs]
            if ok:
                rec["summary"] = summarize([r["_result"] for r in ok], rec["warmup"], COOLDOWN_EPOCHS)
                accs = [r["test_acc"] for r in ok if r.get("test_acc") is not None]
                rec["test_acc"] = statistics.fmean(accs) if accs else None
            errors = [r["error"] for r in recs if r.get("error")]
            if errors:
                rec["error"] = f"{len(errors)} of {len(recs)} repeats failed: " + errors[0]
        out.append(rec)
    for rec in out:
        rec.pop("_result", None)
    return out


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


def _progress(rec: dict[str, Any]) -> None:
    where = f"  {rec['section']:11s} {rec['graph_label']:14s} {rec['mode']:14s} @{rec['ranks']}"
    if rec.get("group"):
        where += f" [{rec['group']}]"
    s = rec.get("summary")
    if s is None:
        print(f"{where}: FAILED {rec.get('error')}", flush=True)
        return
    acc = f" acc {rec['test_acc']:.4f}" if rec.get("test_acc") is not None else ""
    mb = (s["bytes_sent"] or 0) / 1e6
    print(f"{where}: epoch {s['epoch_time']:.3f}s (mean {s['epoch_time_mean']:.3f}) {mb:.2f} MB/epoch"
          f"{' counted, not sent' if is_bound(rec['mode']) else ''}, peak "
          f"{s['memory']['peak_rss_max']:.0f} MiB/rank{acc} [{rec['wall_s']:.0f}s wall]", flush=True)


# -- calibration ---------------------------------------------------------------------------------
def calibrate(args: argparse.Namespace, graph: dict[str, Any], ranks: int, scopes: list[str], balance: str | None,
              run_root: Path, counter: itertools.count, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chooses the per-link rate of ``--link calibrated`` for every scope at one rank count.

    1. ``exact-bound`` unthrottled (no halo transfer; the gradient all-reduce crosses the host
       loopback): its median epoch ``T_c`` and the halo bytes exact sends per epoch (the bound's
       counters count what exact would send; all ranks together and the busiest rank).
    2. Per scope: the bytes the link carries per epoch (halo + ring all-reduce of the gradients,
       :func:`link_bytes_per_epoch`) and ``rate = bytes (1 - t) / (t T_c)`` (t = --target-comm).
    3. A short exact probe at that rate; if its measured communication fraction
       ``(epoch - T_c) / epoch`` misses t by more than --target-band, the rate is rescaled once
       (:func:`rescaled_rate`).
    """
    target = args.target_comm
    warm = max(1, min(args.warmup, 2))
    cal_epochs = max(1, args.calibration_epochs)
    entries: list[dict[str, Any]] = []
    param_bytes = model_param_bytes(args, graph)
    bound = run_config(args, config("calibration", graph, "exact-bound", ranks, warm, cal_epochs, False, link="none",
                                    scope=scopes[0], balance=balance, group="unthrottled"), run_root, next(counter))
    runs.append(bound)
    _progress(bound)
    if not bound.get("summary"):
        raise SystemExit(f"calibration run failed: {bound.get('error')}")
    s = bound["summary"]
    t_c = s["epoch_time"]
    halo_total, halo_max, source = s.get("bytes_sent"), s.get("bytes_sent_max_rank"), "exact-bound counters"
    if not halo_total:
        halo_rows = sum(p.get("halo") or 0 for p in (r.get("partition") or {} for r in bound["ranks_detail"]))
        halo_total = halo_bytes_from_partition(halo_rows, args.hidden, args.layers)
        halo_max = halo_total / ranks * max(
            (p.get("halo") or 0) / max(halo_rows / ranks, 1) for p in (r.get("partition") or {} for r in bound["ranks_detail"]))
        source = "partition estimate (halo rows x hidden x 4 B x 2 directions x (layers - 1))"
    for scope in scopes:
        link_bytes = link_bytes_per_epoch(scope, ranks, halo_total, halo_max or halo_total / ranks, param_bytes)
        entry: dict[str, Any] = {
            "graph_key": graph["key"], "ranks": ranks, "scope": scope, "balance": balance, "target": target,
            "band": args.target_band, "compute_s": t_c, "compute_s_min": s.get("epoch_time_min"),
            "compute_s_max": s.get("epoch_time_max"), "halo_bytes_total": halo_total, "halo_bytes_max_rank": halo_max,
            "bytes_source": source, "param_bytes": param_bytes,
            "allreduce_bytes_per_rank": allreduce_bytes_per_rank(param_bytes, ranks), "link_bytes": link_bytes,
            "bound_run": bound["run_dir"],
        }
        if args.link_rate_bps:
            entry.update(rate_bps=args.link_rate_bps, method="given (--link-rate)", initial_rate_bps=args.link_rate_bps)
            entries.append(entry)
            continue
        rate = calibrated_rate(link_bytes, t_c, target)
        entry.update(initial_rate_bps=rate, method="calibrated")
        probe = run_config(args, config("calibration", graph, "exact", ranks, warm, cal_epochs, False, link="calibrated",
                                        scope=scope, rate_bps=rate, balance=balance, group=f"probe {scope}"),
                           run_root, next(counter))
        runs.append(probe)
        _progress(probe)
        if probe.get("summary"):
            f = comm_fraction(probe["summary"]["epoch_time"], t_c)
            entry["probe"] = {"rate_bps": rate, "epoch_time": probe["summary"]["epoch_time"], "fraction": f,
                              "run_dir": probe["run_dir"]}
            if abs(f - target) > args.target_band:
                rate = rescaled_rate(rate, f, target)
                entry["rescaled"] = True
        entry["rate_bps"] = rate
        print(f"  calibration @{ranks} {scope}: T_c {t_c:.3f}s, {link_bytes / 1e6:.2f} MB/epoch on the link "
              f"(halo {halo_total / 1e6:.2f} MB, all-reduce {entry['allreduce_bytes_per_rank'] / 1e6:.2f} MB/rank) -> "
              f"{entry['initial_rate_bps'] / 1e6:.1f} Mbit/s"
              + (f"; probe {entry['probe']['fraction']:.0%} communication" if "probe" in entry else "")
              + (f" -> rescaled to {rate / 1e6:.1f} Mbit/s" if entry.get("rescaled") else ""), flush=True)
        entries.append(entry)
    return entries


# -- the peer: single-process PyG on the whole graph ------------------------------------------------
def run_peers(args: argparse.Namespace, graph: dict[str, Any], graph_path: Path, run_root: Path) -> list[dict[str, Any]]:
    from peer import summarize_peer, variants_for

    out = []
    for threads in args.peer_threads_list:
        for variant in variants_for(args.conv):
            run_dir = run_root / f"peer-{graph['key']}-{variant}-t{threads}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            spec = {"graph_path": str(graph_path), "variant": variant, "threads": threads, "conv": args.conv,
                    "hidden": args.hidden, "layers": args.layers, "warmup": args.warmup, "epochs": args.epochs,
                    "seed": args.seed, "result_path": str(run_dir / "result.json")}
            (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
            cmd = [sys.executable, str(BENCH_DIR / "run.py"), "--peer", str(run_dir / "spec.json")]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore",
                       PYTHONPATH=os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
            env.update(MALLOC_ENVS[args.malloc])
            rec: dict[str, Any] = {"section": "peer", "graph_key": graph["key"], "graph_label": graph["label"],
                                   "variant": variant, "threads": threads, "run_dir": str(run_dir),
                                   "command": shlex.join(cmd)}
            rc, rec["wall_s"] = run_logged(cmd, env, run_dir / "log.txt", args.timeout)
            result_path = run_dir / "result.json"
            if rc != 0 or not result_path.is_file():
                tail = (run_dir / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
                rec["error"] = f"{'timed out' if rc is None else f'exit status {rc}'}; log {run_dir / 'log.txt'}: " + " / ".join(tail)
                print(f"  peer        {graph['label']:14s} {variant:14s} x{threads}: FAILED {rec['error']}", flush=True)
                if not args.keep_going:
                    raise SystemExit(f"peer {variant} x{threads} failed: {rec['error']}")
            else:
                result = json.loads(result_path.read_text())
                rec.update(nodes=result["nodes"], edges=result["edges"], self_loops=result["self_loops"],
                           build_s=result["build_s"], threads=result["threads"],
                           summary=summarize_peer(result, args.warmup), epochs_detail=result["epochs"])
                s = rec["summary"]
                print(f"  peer        {graph['label']:14s} {variant:14s} x{threads}: epoch {s['epoch_time']:.3f}s "
                      f"(mean {s['epoch_time_mean']:.3f}), peak {s['memory']['peak_rss']:.0f} MiB "
                      f"[{rec['wall_s']:.0f}s wall]", flush=True)
            out.append(rec)
    return out


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--convergence" in argv:
        # time to accuracy: its own runs and report (benchmarks/bench_convergence.py)
        from bench_convergence import main as convergence_main

        return convergence_main([a for a in argv if a != "--convergence"])
    if argv[:1] == ["--worker"]:
        from bench_worker import main as worker_main

        return worker_main(argv[1])
    if argv[:1] == ["--peer"]:
        from peer import main as peer_main

        return peer_main(argv[1])
    if "--scale" in argv:
        # the products-scale sweep (generation, partitioning, training up to 2.45M nodes)
        from bench_scale import main as scale_main

        return scale_main(argv)
    if argv[:1] == ["--render"]:
        # rewrite <name>.md and <name>.png from an existing <name>.json (no benchmark run)
        from bench_report import markdown, plot

        for path in map(Path, argv[1:]):
            report = json.loads(path.read_text())
            png = path.with_suffix(".png")
            has_png = plot(report, str(png))
            path.with_suffix(".md").write_text(markdown(report, png.name if has_png else None))
            print(f"rendered {path.with_suffix('.md')}" + (f" and {png}" if has_png else ""))
        return 0
    args = parse_args(argv)
    COMMUNITY_AVG_DEGREE[0] = args.avg_degree
    started = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(args.cache_dir)
    run_root = cache_dir / "runs" / args.name
    warnings: list[str] = []
    if args.link != "none":
        problem = check_link_support()
        if problem:
            if not args.fallback_none:
                raise SystemExit(
                    f"--link {args.link} needs a private network namespace with a throttled loopback, but {problem}. "
                    "Run as root (or with CAP_NET_ADMIN/CAP_SYS_ADMIN) on Linux with iproute2 and util-linux, or pass "
                    "--link none (or --fallback-none) to benchmark without throttling."
                )
            warnings.append(f"--link {args.link} requested but unavailable ({problem}); ran UNTHROTTLED (--link none)")
            print("WARNING: " + warnings[-1], file=sys.stderr)
            args.link = "none"
    main_ranks = _ints(args.ranks)
    scaling_nodes = _ints(args.scaling_nodes)
    scaling_ranks = _ints(args.scaling_ranks)
    acc_ranks = _ints(args.accuracy_ranks)
    scopes = args.scope_list
    balances: list[str | None] = list(args.balance_list) or [None]
    import torch

    torch.set_num_threads(1)
    print(f"[{args.name}] preparing graphs and partitions ...", flush=True)
    graphs: dict[str, dict[str, Any]] = {}

    def graph(kind: str, nodes: int, parts: list[int], bals: list[str | None]) -> dict[str, Any]:
        info = prepare_graph(kind, nodes, parts, cache_dir, args.seed, bals)
        if info["key"] in graphs:
            graphs[info["key"]]["partitions"].update(info["partitions"])
        else:
            graphs[info["key"]] = info
        return graphs[info["key"]]

    main_graph = graph(args.graph, args.nodes, main_ranks, balances) if main_ranks else None
    peer_graph_path = None
    if main_graph is not None and not args.no_peer:
        from peer import save_graph

        peer_graph_path = cache_dir / "graphs" / f"{main_graph['key']}-s{args.seed}.pt"
        if not peer_graph_path.is_file():
            save_graph(_LOADED[(args.graph, args.nodes)][0], peer_graph_path)
    scaling_graphs = [graph("community", n, scaling_ranks, balances[:1]) for n in scaling_nodes]
    acc_graph = graph(args.accuracy, args.nodes, acc_ranks, balances[:1]) if args.accuracy else None
    counter = itertools.count()
    runs: list[dict[str, Any]] = []
    # the calibrated link: a rate per (scope, rank count), chosen before the comparison runs
    rates: dict[tuple[str, int], float] = {}
    calibration: list[dict[str, Any]] = []
    if args.link == "calibrated" and main_graph is not None:
        print(f"[{args.name}] calibrating the link: exact-bound unthrottled, then an exact probe per scope ...", flush=True)
        for r in main_ranks:
            for entry in calibrate(args, main_graph, r, scopes, balances[0], run_root, counter, runs):
                calibration.append(entry)
                rates[(entry["scope"], r)] = entry["rate_bps"]
    # the calibrated rate belongs to the main graph; other sections then run unthrottled
    side_link = "none" if args.link == "calibrated" else args.link
    if side_link != args.link and (scaling_graphs or acc_graph is not None):
        warnings.append("--link calibrated: the scaling and accuracy runs ran unthrottled (the rate is calibrated "
                        "for the main comparison only)")
    plan: list[dict[str, Any]] = []
    for scope in scopes:
        for bi, balance in enumerate(balances):
            modes = args.modes_list if bi == 0 else [m for m in args.modes_list if m in ("exact", "exact-bound")] or ["exact"]
            label = " · ".join(([scope] if len(scopes) > 1 else []) + ([f"balance {balance}"] if len(balances) > 1 else []))
            for r in main_ranks:
                for mode in modes:
                    plan.append(config("main", main_graph, mode, r, args.warmup, args.epochs, args.graph == "cora",
                                       link=args.link, scope=scope, rate_bps=rates.get((scope, r)), balance=balance,
                                       group=label))
    for g in scaling_graphs:
        for r in scaling_ranks:
            if (g is main_graph and r in main_ranks and "exact" in args.modes_list and side_link == args.link
                    and len(scopes) == 1 and len(balances) == 1):
                continue  # the main comparison's exact run is this point
            plan.append(config("scaling", g, "exact", r, 1, args.scaling_epochs, False, link=side_link, scope=scopes[0],
                               balance=balances[0]))
    if acc_graph is not None:
        for r in acc_ranks:
            for mode in args.modes_list:
                if not is_bound(mode):
                    # trains every epoch; the summary (traffic, time) skips the first few
                    w = min(5, args.accuracy_epochs // 2)
                    plan.append(config("accuracy", acc_graph, mode, r, w, args.accuracy_epochs - w, True,
                                       link=side_link, scope=scopes[0], balance=balances[0]))
    _, link_desc = link_wrapper(args.link, scopes[0], max(main_ranks + scaling_ranks + acc_ranks + [1]),
                                next(iter(rates.values()), None) if args.link == "calibrated" else None)
    if args.link == "calibrated":
        link_desc = ("calibrated per scope and rank count so that exact spends "
                     f"{args.target_comm:.0%} of its epoch communicating (see the calibration table)")
    elif len(scopes) > 1:
        link_desc += f"; scopes {', '.join(scopes)}"
    print(f"[{args.name}] {len(plan)} configurations, link: {link_desc}", flush=True)
    main_plan = [c for c in plan if c["section"] == "main"]
    for k in range(1, args.repeat):
        # repeats of the mode comparison, in reverse order every other round, so that a drift in
        # the host's load does not favour the modes that happen to run first
        plan += [dict(c, repeat=k) for c in (main_plan[::-1] if k % 2 else main_plan)]
    print(f"[{args.name}] {len(plan)} runs ({args.repeat} round(s) of the mode comparison)"
          + ("" if peer_graph_path is None else f" + {(3 if args.conv == 'gcn' else 2) * len(args.peer_threads_list)} peer runs"),
          flush=True)
    load_before = _load()
    for cfg in plan:
        rec = run_config(args, cfg, run_root, next(counter))
        _progress(rec)
        runs.append(rec)
    peers = run_peers(args, main_graph, peer_graph_path, run_root) if peer_graph_path is not None else []
    runs = merge_repeats(runs)
    report = {
        "name": args.name,
        "created": datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/run.py " + shlex.join(argv),
        "config": {k: getattr(args, k) for k in (
            "preset", "graph", "nodes", "conv", "hidden", "layers", "ranks", "modes", "link", "link_scope",
            "warmup", "epochs", "staleness", "assign_every", "first_assign", "link_costs", "scaling_nodes", "scaling_ranks",
            "scaling_epochs", "accuracy", "accuracy_ranks", "accuracy_epochs", "malloc", "repeat", "seed",
            "balance", "target_comm", "target_band", "calibration_epochs", "bound_tolerance", "link_rate_bps")},
        "link": {"name": args.link, "scope": ",".join(scopes), "description": link_desc},
        "host": {"cpus": os.cpu_count(), "cores_available": peer_thread_counts()[0], "load_before": load_before,
                 "load_after": _load(), "python": sys.version.split()[0], "torch": torch.__version__,
                 "threads_per_rank": 1, "partitioner_balance_option": supports_balance()},
        "graphs": graphs,
        "warnings": warnings,
        "calibration": calibration,
        "runs": runs,
        "peer": peers,
        "total_wall_s": time.perf_counter() - started,
    }
    from bench_report import bound_checks, markdown, plot

    for check in bound_checks(report):
        if check["flag"]:
            print(f"WARNING: {check['message']}", file=sys.stderr)
    png = out_dir / f"{args.name}.png"
    has_png = plot(report, str(png))
    if not has_png:
        report["warnings"].append("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
    (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / f"{args.name}.md").write_text(markdown(report, png.name if has_png else None))
    print(f"[{args.name}] done in {report['total_wall_s']:.0f}s: {out_dir / args.name}.{{json,md,png}}", flush=True)
    print((out_dir / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
