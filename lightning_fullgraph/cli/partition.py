"""``lightning-fullgraph partition``: partition a graph into the cache ahead of training, print statistics.

Per-part statistics, and for large parts the allocator environment to train with."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_fullgraph.cli.names import PROG


def _partition_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} partition",
        description=(
            "Partition a graph into the partition cache (or reuse a valid cached partition) and print "
            "per-part statistics. Give the printed folder to `fit` as --data.data=<folder> with as many "
            "devices as parts: ranks then read only their own part."
        ),
    )
    parser.add_argument(
        "--data",
        default="community",
        help="dataset name (community, Cora, ogbn-arxiv, ...) or a partition folder (default: community)",
    )
    parser.add_argument(
        "--root", default=None, help="dataset folder for named datasets (e.g. ../shared/datasets/Planetoid)"
    )
    parser.add_argument(
        "--num-parts", type=int, default=2, help="number of parts = training ranks (default: 2)"
    )
    parser.add_argument(
        "--method", choices=("metis", "random"), default="metis", help="partitioner (default: metis)"
    )
    parser.add_argument("--seed", type=int, default=0, help="partitioner seed (default: 0)")
    parser.add_argument(
        "--balance",
        choices=("edges", "nodes"),
        default="edges",
        help=(
            "what metis balances across the parts: 'edges' = the in-edges each part aggregates, which "
            "dominate a rank's compute time, or 'nodes' = node counts (default: edges; random ignores it)"
        ),
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="partition cache (default: $LIGHTNING_FULLGRAPH_CACHE or $XDG_CACHE_HOME/lightning-fullgraph/partitions)",
    )
    parser.add_argument(
        "--dataset-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="extra load_dataset arguments as a JSON object, e.g. '{\"num_nodes\": 10000}'",
    )
    parser.add_argument(
        "--metis-max-edges",
        type=int,
        default=None,
        metavar="M",
        help=(
            "bound METIS' memory (about 120 bytes per undirected edge): give it a deterministic sample of at "
            "most M undirected edges of a larger graph; every edge is still kept in the parts (default: no bound)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def part_statistics(folder: str | Path) -> list[dict[str, Any]]:
    """Per-part statistics of a partition folder (reads every part file once).

    Every directed edge lives in the part owning its destination; it is *cut* when its
    source is a halo node (owned by another part), exactly as in
    :func:`~lightning_fullgraph.partition.partitioner.partition_stats`.

    Returns:
        One dict per part: ``part``, ``owned`` (nodes it owns), ``halo``, ``local_edges``
        (edges whose destination it owns: its aggregation work), ``cut_edges`` and
        ``cut_fraction`` (cut edges / local edges).
    """
    from lightning_fullgraph.partition.cache import load_part, read_manifest

    manifest = read_manifest(folder)
    rows = []
    for rank in range(len(manifest.get("parts", []))):
        part = load_part(folder, rank)
        edge_index = part.data.edge_index
        cut = int((edge_index[0] >= part.plan.num_owned).sum())
        local = int(edge_index.size(1))
        rows.append(
            {
                "part": rank,
                "owned": part.plan.num_owned,
                "halo": part.plan.num_halo,
                "local_edges": local,
                "cut_edges": cut,
                "cut_fraction": cut / local if local else 0.0,
            }
        )
    return rows


def _imbalance(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``node_imbalance`` and ``edge_imbalance`` (max / mean over the parts) of the rows."""
    from lightning_fullgraph.partition.partitioner import imbalance

    return {
        "node_imbalance": imbalance([r["owned"] for r in rows]),
        "edge_imbalance": imbalance([r["local_edges"] for r in rows]),
    }


def _imbalance_line(rows: list[dict[str, Any]]) -> str:
    imb = _imbalance(rows)
    return (
        f"imbalance: nodes max/mean {imb['node_imbalance']:.3f}, edges max/mean {imb['edge_imbalance']:.3f}"
    )


def _format_table(rows: list[dict[str, Any]]) -> str:
    columns = ("part", "owned", "halo", "local_edges", "cut_edges", "cut_fraction")
    total_edges = sum(r["local_edges"] for r in rows)
    total_cut = sum(r["cut_edges"] for r in rows)
    total = {
        "part": "total",
        "owned": sum(r["owned"] for r in rows),
        "halo": sum(r["halo"] for r in rows),
        "local_edges": total_edges,
        "cut_edges": total_cut,
        "cut_fraction": total_cut / total_edges if total_edges else 0.0,
    }

    def cell(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    table = [list(columns)] + [[cell(r[c]) for c in columns] for r in [*rows, total]]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in table)


def partition_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-fullgraph partition``: partition a graph into the cache, print statistics.

    Args:
        argv: Arguments after ``partition`` (``None``: ``sys.argv[2:]``).

    Returns:
        The exit status (0).
    """
    args = _partition_parser().parse_args(sys.argv[2:] if argv is None else list(argv))
    if args.num_parts < 1:
        raise SystemExit(f"{PROG} partition: --num-parts must be >= 1, got {args.num_parts}")
    if args.dataset_kwargs is not None and not isinstance(args.dataset_kwargs, dict):
        raise SystemExit(f"{PROG} partition: --dataset-kwargs must be a JSON object")

    from lightning_fullgraph._os import max_rss_mib
    from lightning_fullgraph.data.datamodule import load_graph
    from lightning_fullgraph.partition.cache import (
        PartitionResult,
        check_manifest,
        ensure_partitions,
        read_manifest,
    )

    baseline_rss = max_rss_mib()  # torch, PyG, this package imported: what any process costs
    start = time.perf_counter()
    given = Path(args.data)
    if (given / "manifest.json").is_file():
        reason = check_manifest(given, {})
        if reason is not None:
            raise SystemExit(f"{PROG} partition: cannot use {given}: {reason}")
        result = PartitionResult(folder=given, rebuilt=False, reason="partition folder given")
    else:
        from lightning_fullgraph.data.datasets import generated_fingerprint, is_generated_name

        kwargs = args.dataset_kwargs or {}
        graph: Any
        fingerprint = None
        if is_generated_name(args.data):
            # a generated graph is keyed by its name and arguments: a cache hit never builds it
            fingerprint = generated_fingerprint(args.data, **kwargs)

            def graph() -> Any:
                return load_graph(args.data, root=args.root, **kwargs)
        else:
            graph = load_graph(args.data, root=args.root, **kwargs)
        load_s = time.perf_counter() - start
        result = ensure_partitions(
            graph,
            args.num_parts,
            method=args.method,
            seed=args.seed,
            cache_root=args.cache_dir,
            balance=args.balance,
            fingerprint=fingerprint,
            metis_max_edges=args.metis_max_edges,
        )
        del graph
        if fingerprint is None:
            result.timings = {"load": load_s, **result.timings}
    timings = {
        "load": 0.0,
        "check": 0.0,
        "metis": 0.0,
        "plan": 0.0,
        "write": 0.0,
        **getattr(result, "timings", {}),
    }
    phase_peaks = dict(getattr(result, "peak_rss_mib", {}))
    manifest = read_manifest(result.folder)
    stats_start = time.perf_counter()
    rows = part_statistics(result.folder)
    timings["statistics"] = time.perf_counter() - stats_start
    elapsed = time.perf_counter() - start
    # This process, or it and the forked orderings together (a bound) where that is more.
    process_peak_rss = max_rss_mib()
    peak_rss = max(process_peak_rss, getattr(result, "forked_peak_mib", 0.0))
    folder = Path(result.folder).resolve()
    # the global graph's own size: edge_index (int64) + x (float32) + y (int64) + 3 bool masks
    n, e, f = (manifest.get(k) or 0 for k in ("num_nodes", "num_edges", "num_features"))
    graph_mib = (16 * e + 4 * n * f + 8 * n + 3 * n) / 2**20
    if args.json:
        summary = {
            "folder": str(folder),
            "cache_hit": not result.rebuilt,
            "reason": result.reason,
            "partition_seconds": result.seconds,
            "total_seconds": elapsed,
            "phase_seconds": timings,
            "peak_rss_mib": peak_rss,
            "process_peak_rss_mib": process_peak_rss,
            "forked_peak_mib": getattr(result, "forked_peak_mib", 0.0),
            "baseline_rss_mib": baseline_rss,
            "phase_peak_rss_mib": phase_peaks,
            "graph_mib": graph_mib,
            **{
                k: manifest.get(k)
                for k in ("method", "balance", "num_parts", "seed", "num_nodes", "num_edges")
            },
            "metis_max_edges": manifest.get("metis_max_edges"),
            "total_halo": manifest.get("total_halo"),
            **{k: manifest.get(k) for k in ("num_features", "num_classes")},
            "nodes_per_part": [r["owned"] for r in rows],
            "edges_per_part": [r["local_edges"] for r in rows],
            **_imbalance(rows),
            "parts": rows,
        }
        print(json.dumps(summary, indent=1))
        return 0
    reason = "not in the cache yet" if result.reason.startswith("no partition manifest") else result.reason
    status = "cache hit" if not result.rebuilt else f"built in {result.seconds:.2f} s ({reason})"
    if result.reason == "partition folder given":
        status = "existing partition folder"
    print(f"partition folder: {folder}")
    print(f"status: {status}; total {elapsed:.2f} s")
    print(
        "time: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items() if v or k in ("check", "statistics"))
        + f"; peak memory (VmHWM, METIS and forked orderings included) {peak_rss:.0f} MiB "
        f"({peak_rss - baseline_rss:.0f} above the "
        f"{baseline_rss:.0f} MiB after imports), {(peak_rss - baseline_rss) / max(graph_mib, 1e-9):.2f}x the graph's "
        f"{graph_mib:.0f} MiB"
        + (
            ""
            if not phase_peaks
            else " (" + ", ".join(f"after {k} {v:.0f}" for k, v in phase_peaks.items()) + ")"
        )
    )
    if not result.rebuilt and result.reason != "partition folder given":
        print(f"cache reused: {result.reason}, nothing recomputed ({elapsed:.2f} s in all)")
    print(
        f"graph: {manifest.get('num_nodes')} nodes, {manifest.get('num_edges')} edges, "
        f"{manifest.get('num_features')} features, {manifest.get('num_classes')} classes; "
        f"method {manifest.get('method')}, balance {manifest.get('balance', 'nodes (old manifest)')}, "
        f"{manifest.get('num_parts')} parts, seed {manifest.get('seed')}"
    )
    print(_format_table(rows))
    print(_imbalance_line(rows))
    print(f"train on it: {PROG} fit --data.data={folder} --trainer.devices={manifest.get('num_parts')}")
    hint = allocator_hint(rows, os.environ)
    if hint:
        print(hint)
    return 0


#: Rows (owned + halo) of a part from which its ``[rows, 128]`` fp32 activations exceed glibc's
#: largest mmap threshold (32 MiB): every such tensor is mapped, faulted in and zeroed afresh.
LARGE_PART_ROWS = 65_536
#: The allocator environment the README's "Large graphs on CPU" section measured.
ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": "2097152"}


def allocator_hint(parts: Sequence[dict[str, Any]], environ: Any) -> str | None:
    """The line ``partition`` prints when its largest part would train faster on CPU with
    :data:`ALLOCATOR_ENV` (which must be set before Python starts, so it is only suggested),
    or ``None``: parts below :data:`LARGE_PART_ROWS` rows, or the variables already set.

    Args:
        parts: Per-part statistics with ``owned`` and ``halo`` row counts.
        environ: The environment the training job would inherit (``os.environ``).
    """
    largest = max((int(p["owned"]) + int(p["halo"]) for p in parts), default=0)
    missing = {k: v for k, v in ALLOCATOR_ENV.items() if k not in environ}
    if largest < LARGE_PART_ROWS or not missing:
        return None
    env = " ".join(f"{k}={v}" for k, v in missing.items())
    return (
        f"on CPU: a part holds up to {largest:,} rows; with `{env}` in the environment of `{PROG} fit` its "
        "large tensors use transparent huge pages and leave no fragmented heap (products-like graphs, 4 ranks: "
        "peaks 32-54 % lower at 10^5 nodes, epochs 11-26 % shorter from 10^6 nodes on; README, 'Large graphs on CPU')"
    )
