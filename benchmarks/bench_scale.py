"""``run.py --scale``: how time and memory grow up to an ogbn-products-sized graph.

For every size of ``--scale-nodes`` (default 10^5, 3*10^5, 10^6, 2,449,029 nodes, the
generated ``products-like`` graph at products' mean degree 50.5) this sweep

1. generates the graph in a fresh process and records its wall time, peak RSS and
   statistics (mean / median / max degree, edge homophily);
2. partitions it with ``python -m lightning_fullgraph partition --data products-like
   --num-parts P --json`` (a fresh process: its peak RSS includes METIS), twice (the
   second run must reuse the cache);
3. trains ``--scale-ranks`` (4) ranks for ``--warmup`` + ``--epochs`` epochs (plus one
   unmeasured cool-down epoch) in every mode of ``--scale-modes`` with every conv of
   ``--scale-convs`` (hidden ``--hidden``, 3 layers, no link emulation), through the same
   worker as the other benchmarks (``run.py --worker``: per-rank epoch time, peak RSS above
   the rank's import baseline, halo counts);
4. at the sizes of ``--scale-single`` trains one rank (exact) on the whole graph: the
   single-process memory need the per-rank goal is judged against (extrapolated to the
   larger sizes with its fitted exponent).

It writes ``<out>/<name>.json`` / ``.md`` / ``.png`` (log-log plot) with least-squares
exponents (``y ~ E^a`` over the sizes) and the goals: per-rank peak above baseline <= 1.3 x
single-process need / P + halo rows; partition peak <= 3x the graph's size; epoch time
and partition time exponents in edges <= 1.1.  Every process it starts runs with the allocator environment of
``--malloc`` (``common.py``'s ``MALLOC_ENVS``; default ``thp``: transparent huge pages for
torch's large allocations and a fixed 2 MiB glibc mmap threshold), recorded in the report.
Not part of CI: the full sweep takes about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
FULL_NODES = 2_449_029

# Host calibration: what one 8-byte read per edge from an [N] table costs at this N, at random
# positions (what graph algorithms on a graph with structure-free ids do: METIS, the
# generator's searches, the planner's lookups) and in ascending order (a streaming pass).
_GATHER_SNIPPET = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
n, e = int(sys.argv[1]), int(sys.argv[2])
table = torch.arange(n)
count = min(e, 1 << 24)
idx = torch.randint(n, (count,), generator=torch.Generator().manual_seed(0))
out = {"count": count}
for name, i in (("random", idx), ("ascending", torch.sort(idx).values)):
    table[i]
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        table[i]
        ts.append(time.perf_counter() - t)
    out[name + "_ns"] = sorted(ts)[2] / count * 1e9
print(json.dumps(out))
"""

_GEN_SNIPPET = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
from lightning_fullgraph.data.datasets import products_like_graph
from lightning_fullgraph._os import max_rss_mib  # VmHWM (ru_maxrss survives fork+exec)
base = max_rss_mib()
t1 = time.perf_counter()
d = products_like_graph(num_nodes=int(sys.argv[1]), seed=int(sys.argv[2]))
gen_s = time.perf_counter() - t1
peak = max_rss_mib()
n, ei = d.num_nodes, d.edge_index
deg = torch.bincount(ei[0], minlength=n)
same = 0
step = 1 << 22
for lo in range(0, ei.size(1), step):
    same += int((d.y[ei[0, lo:lo + step]] == d.y[ei[1, lo:lo + step]]).sum())
size = (ei.numel() * ei.element_size() + d.x.numel() * 4 + d.y.numel() * 8 + 3 * n) / 2**20
print(json.dumps({
    "nodes": n, "edges": int(ei.size(1)), "seconds": gen_s, "import_rss_mib": base, "peak_rss_mib": peak,
    "peak_above_import_mib": peak - base, "graph_mib": size, "degree_mean": float(deg.float().mean()),
    "degree_median": float(deg.median()), "degree_max": int(deg.max()), "isolated": int((deg == 0).sum()),
    "homophily": same / max(ei.size(1), 1), "train": int(d.train_mask.sum()), "val": int(d.val_mask.sum()),
    "test": int(d.test_mask.sum()), "load": os.getloadavg(),
}))
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    from common import (  # run.py put this folder on sys.path: it imported us
        MALLOC_ENVS,
        settle_assign_schedule,
    )

    p = argparse.ArgumentParser(prog="run.py --scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", action="store_true")
    p.add_argument("--name", default="scale")
    p.add_argument("--out-dir", default=str(BENCH_DIR / "results"))
    p.add_argument("--cache-dir", default=str(BENCH_DIR / ".cache"))
    p.add_argument("--scale-nodes", default=f"100000,300000,1000000,{FULL_NODES}")
    p.add_argument("--scale-ranks", type=int, default=4)
    p.add_argument("--scale-modes", default="exact,adaqp,sylvie")
    p.add_argument("--scale-convs", default="gcn,sage")
    p.add_argument(
        "--scale-single",
        default="100000,300000",
        help="sizes at which one rank trains on the whole graph (the single-process need)",
    )
    p.add_argument("--full-convs", help="convs at the largest size (default: --scale-convs)")
    p.add_argument(
        "--metis-fraction",
        type=float,
        default=0.25,
        help="METIS sees a sample of this fraction of the undirected edges (partition --metis-max-edges); "
        "0 = every edge (METIS then needs ~240 bytes per undirected edge, 5x the graph)",
    )
    p.add_argument(
        "--partition-repeats",
        type=int,
        default=1,
        help="partition every size this many times, each on a cold cache of its own; the report keeps the run "
        "of median time (all times listed) and fits the exponents on those medians",
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--staleness", type=int, default=5)
    p.add_argument(
        "--assign-every",
        type=int,
        help="adaqp: epochs between bit-width assignments (default: the warm-up, so every measured epoch of "
        "--warmup 1 holds one: the worst case)",
    )
    p.add_argument(
        "--first-assign",
        type=int,
        help="adaqp: epoch of the first assignment (default: --assign-every). --first-assign 1 --assign-every 50 "
        "--warmup 2 measures steady epochs at the assigned widths, as under the default schedule",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--keep-going", action="store_true")
    p.add_argument(
        "--malloc",
        choices=tuple(MALLOC_ENVS),
        default="thp",
        help="the allocator environment of every process the sweep starts (run.py --malloc; default thp: "
        "transparent huge pages and a fixed 2 MiB mmap threshold)",
    )
    p.add_argument("--render", help="redraw <name>.md/.png from this JSON only")
    p.add_argument(
        "--merge",
        action="append",
        default=[],
        help="with --render: add the runs and sizes of this report JSON first (its successful runs, and "
        "its sizes partitioned afresh, replace the same ones)",
    )
    args = p.parse_args(argv)
    settle_assign_schedule(p, args)
    args.nodes_list = [int(x) for x in args.scale_nodes.split(",") if x.strip()]
    args.single_list = [int(x) for x in args.scale_single.split(",") if x.strip()]
    args.modes_list = [m.strip() for m in args.scale_modes.split(",") if m.strip()]
    args.convs_list = [c.strip() for c in args.scale_convs.split(",") if c.strip()]
    args.full_convs_list = [c.strip() for c in (args.full_convs or args.scale_convs).split(",") if c.strip()]
    return args


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _env(malloc: str = "default") -> dict[str, str]:
    import common

    env = dict(os.environ)
    env.update(common.MALLOC_ENVS[malloc])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def generate(n: int, seed: int, log: Path, malloc: str = "default") -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _GEN_SNIPPET, str(n), str(seed)],
        cwd=REPO,
        env=_env(malloc),
        capture_output=True,
        text=True,
    )
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"generating {n} nodes failed; see {log}")
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def gather_calibration(n: int, edges: int, malloc: str = "default") -> dict[str, Any]:
    """Nanoseconds per read of an ``[n]`` int64 table at random and at ascending positions
    (median of 5 passes of ``min(edges, 2^24)`` reads, one thread, the partitioner's
    allocator environment)."""
    proc = subprocess.run(
        [sys.executable, "-c", _GATHER_SNIPPET, str(n), str(edges)],
        cwd=REPO, env=_env(malloc), capture_output=True, text=True, check=True,
    )  # fmt: skip
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    rec["load"] = _load()
    return rec


def partition(
    n: int, parts: int, cache: Path, log: Path, metis_max_edges: int | None, malloc: str = "default"
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "lightning_fullgraph",
        "partition",
        "--data",
        "products-like",
        "--dataset-kwargs",
        json.dumps({"num_nodes": n}),
        "--num-parts",
        str(parts),
        "--cache-dir",
        str(cache),
        "--json",
    ]
    if metis_max_edges is not None and parts > 1:
        cmd += ["--metis-max-edges", str(metis_max_edges)]
    load_before = _load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(malloc), capture_output=True, text=True)
    log.write_text(shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"partitioning {n} nodes into {parts} failed; see {log}")
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    out.pop("parts", None)
    out.update(
        command=shlex.join(cmd),
        process_wall_s=time.perf_counter() - t0,
        load_before=load_before,
        load_after=_load(),
    )
    return out


def _median_partition(
    args: argparse.Namespace, n: int, first: dict[str, Any], cache: Path, logs: Path, bound: int | None
) -> dict[str, Any]:
    """Partitions ``n`` nodes ``args.partition_repeats - 1`` more times, each on a cold cache of
    its own (deleted afterwards), and returns the run of median ``partition_seconds`` with
    every run's seconds under ``repeats_seconds``.  ``first`` (in the shared cache, which the
    reuse check and the training use) counts as one run."""
    runs = [first]
    for k in range(1, args.partition_repeats):
        folder = cache / f"partitions-repeat{k}"
        shutil.rmtree(folder, ignore_errors=True)
        runs.append(partition(n, args.scale_ranks, folder, logs / f"part-{n}-repeat{k}.log", bound, args.malloc))
        shutil.rmtree(folder, ignore_errors=True)
    seconds = [r["partition_seconds"] for r in runs]
    median = sorted(runs, key=lambda r: r["partition_seconds"])[(len(runs) - 1) // 2]
    return {**median, "folder": first["folder"], "repeats_seconds": seconds}


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x) (None with fewer than two positive points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x and y and x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def run_args(args: argparse.Namespace, conv: str) -> argparse.Namespace:
    """The options one training run of the sweep takes (``common.run_config``'s): the sweep's,
    with ``conv`` and measured link costs (adaqp's schedule, ``--first-assign`` and
    ``--assign-every``, passes through)."""
    a = copy.copy(args)
    a.conv = conv
    a.link_costs = "measure"
    return a


def train(
    args: argparse.Namespace,
    conv: str,
    mode: str,
    ranks: int,
    folder: str,
    n: int,
    index: int,
    run_root: Path,
) -> dict[str, Any]:
    import common

    a = run_args(args, conv)
    graph = {
        "key": f"products-like-{n}-{conv}",
        "label": f"products-like {n}",
        "nodes": n,
        "features": 100,
        "classes": 47,
        "partitions": {str(ranks): {"folder": folder}},
    }
    cfg = common.config(
        "scale", graph, mode, ranks, args.warmup, args.epochs, False, link="none", scope="shared"
    )
    load_before = _load()
    rec = common.run_config(a, cfg, run_root, index)
    rec.update(conv=conv, load_before=load_before, load_after=_load(), nodes=n)
    rec.pop("_result", None)
    return rec


def memory_guard(runs: list[dict[str, Any]], conv: str, mode: str, ranks: int, edges: int) -> str | None:
    """A reason not to run a configuration: its ranks' memory (the import baseline plus what is
    above it, extrapolated in edges from the same configuration at the largest smaller size)
    would not fit in what the machine has available now (2 GiB to spare).

    The extrapolation uses the slope between the two largest smaller sizes on log-log axes
    (bounded to [0.5, 1]; linear with one size): a rank's memory grows sublinearly here
    (0.7-0.9 from 10^6 to full size), and a linear guess skipped full-size runs that fit.
    """
    import psutil

    prev = [
        r
        for r in runs
        if r["conv"] == conv and r["mode"] == mode and r["ranks"] == ranks and r.get("summary")
    ]
    if not prev:
        return None
    prev.sort(key=lambda r: r["graph_edges"])
    last = prev[-1]
    slope = 1.0
    if len(prev) >= 2:
        fitted = fit_exponent(
            [r["graph_edges"] for r in prev[-2:]], [_mem(r, "peak_above_baseline_max") or 0.0 for r in prev[-2:]]
        )
        slope = min(1.0, max(0.5, fitted)) if fitted is not None else 1.0
    # the import baseline does not grow with the graph; what is above it grows as edges^slope
    base = (_mem(last, "peak_rss_max") or 0.0) - (_mem(last, "peak_above_baseline_max") or 0.0)
    per_rank = base + (_mem(last, "peak_above_baseline_max") or 0.0) * (edges / last["graph_edges"]) ** slope
    available = psutil.virtual_memory().available / 2**20
    if ranks * per_rank + 2048 > available:
        return (
            f"{ranks} x {per_rank:.0f} MiB (extrapolated from {last['graph_edges']:,} edges as edges^{slope:.2f}) + 2 GiB > "
            f"{available:.0f} MiB available"
        )
    return None


def _mem(rec: dict[str, Any], key: str) -> float | None:
    return ((rec.get("summary") or {}).get("memory") or {}).get(key)


def analyse(report: dict[str, Any]) -> dict[str, Any]:
    """Exponents and goal checks from the raw records."""
    sizes = report["sizes"]
    hidden, layers, parts = (
        report["config"]["hidden"],
        report["config"]["layers"],
        report["config"]["scale_ranks"],
    )
    edges = [s["partition"]["num_edges"] for s in sizes]
    out: dict[str, Any] = {"exponents": {}, "goals": []}
    ex = out["exponents"]
    ex["partition_seconds"] = fit_exponent(edges, [s["partition"]["partition_seconds"] for s in sizes])
    ex["partition_peak_rss"] = fit_exponent(edges, [s["partition"]["peak_rss_mib"] for s in sizes])
    ex["generation_seconds"] = fit_exponent(edges, [s["generate"]["seconds"] for s in sizes])
    for phase in ("load", "metis", "plan", "write"):
        ex[f"partition_phase/{phase}"] = fit_exponent(
            edges, [s["partition"]["phase_seconds"].get(phase) for s in sizes]
        )
    # one random (ascending) read per edge: the host's own growth for a random-access bound
    # (streaming) O(E) pass over node-indexed data, the reference for the partition phases
    for kind in ("random", "ascending"):
        pts = [(e, s["gather"][f"{kind}_ns"] * e) for e, s in zip(edges, sizes, strict=True) if s.get("gather")]
        ex[f"host_{kind}_read_per_edge"] = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
    runs = report["runs"]
    combos = sorted({(r["conv"], r["mode"]) for r in runs if r["ranks"] == parts})
    for conv, mode in combos:
        pts = [
            (r["graph_edges"], r["summary"]["epoch_time"])
            for r in runs
            if r["conv"] == conv and r["mode"] == mode and r["ranks"] == parts and r.get("summary")
        ]
        ex[f"epoch_time/{conv}/{mode}"] = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
        pts = [
            (r["graph_edges"], _mem(r, "peak_above_baseline_max"))
            for r in runs
            if r["conv"] == conv and r["mode"] == mode and r["ranks"] == parts and r.get("summary")
        ]
        ex[f"rank_peak_above_baseline/{conv}/{mode}"] = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
    # single-process need: 1-rank exact runs, fitted and extrapolated in edges
    single: dict[str, Any] = {}
    for conv in sorted({r["conv"] for r in runs if r["ranks"] == 1}):
        pts = [
            (r["graph_edges"], _mem(r, "peak_above_baseline_max"))
            for r in runs
            if r["conv"] == conv and r["ranks"] == 1 and r.get("summary")
        ]
        a = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
        single[conv] = {"points": pts, "exponent": a}
        ex[f"single_process_need/{conv}"] = a
        # The same compute path in one process (no partition, no halo): how this host's
        # per-edge cost grows by itself, the reference for the 4-rank epoch exponents.
        pts = [(r["graph_edges"], r["summary"]["epoch_time"]) for r in runs if r["conv"] == conv and r["ranks"] == 1 and r.get("summary")]
        ex[f"single_process_epoch_time/{conv}"] = fit_exponent([p[0] for p in pts], [p[1] for p in pts])
    out["single"] = single

    def single_need(conv: str, e: int) -> tuple[float | None, bool]:
        info = single.get(conv)
        if not info or not info["points"]:
            return None, False
        for pe, mib in info["points"]:
            if pe == e:
                return mib, False
        pe, mib = max(info["points"])
        a = info["exponent"] if info["exponent"] is not None else 1.0
        return mib * (e / pe) ** a, True

    for s in sizes:
        p = s["partition"]
        above = p["peak_rss_mib"] - p.get("baseline_rss_mib", 0.0)
        out["goals"].append(
            {
                "what": f"partition peak above imports <= 3x graph, {s['nodes']} nodes",
                "value": above / p["graph_mib"],
                "limit": 3.0,
                "ok": above <= 3 * p["graph_mib"],
                "detail": f"{p['peak_rss_mib']:.0f} MiB peak{_forked_note(p)}, {p.get('baseline_rss_mib', 0):.0f} "
                f"after imports, graph {p['graph_mib']:.0f} MiB; METIS saw {p.get('metis_max_edges') or 'every'} "
                "undirected edges",
            }
        )
    for r in runs:
        if r["ranks"] != parts or not r.get("summary"):
            continue
        need, extrapolated = single_need(r["conv"], r["graph_edges"])
        if need is None:
            continue
        halo_max = (r["summary"].get("partition") or {}).get("halo_max") or 0
        # received rows: the input features and, per later layer, hidden rows forward + gradient back
        halo_mib = halo_max * 4 * (report["graph_features"] + 2 * hidden * (layers - 1)) / 2**20
        limit = 1.3 * need / parts + halo_mib
        val = _mem(r, "peak_above_baseline_max")
        out["goals"].append(
            {
                "what": f"rank peak above baseline, {r['conv']} {r['mode']}, {r['nodes']} nodes",
                "value": val,
                "limit": limit,
                "ok": val is not None and val <= limit,
                "detail": f"single-process need {need:.0f} MiB{' (extrapolated)' if extrapolated else ''}, "
                f"halo rows {halo_mib:.0f} MiB",
            }
        )
    for key, val in ex.items():
        if key.startswith("epoch_time/") and val is not None:
            out["goals"].append(
                {
                    "what": f"epoch time exponent in edges, {key[11:]}",
                    "value": val,
                    "limit": 1.1,
                    "ok": val <= 1.1,
                    "detail": "",
                }
            )
    val = ex.get("partition_seconds")
    if val is not None:
        phases = ", ".join(
            f"{k.split('/')[1]} {_fmt(v, 2)}" for k, v in ex.items() if k.startswith("partition_phase/")
        )
        out["goals"].append(
            {
                "what": "partition time exponent in edges (generation included)",
                "value": val,
                "limit": 1.1,
                "ok": val <= 1.1,
                "detail": f"phases: {phases}; one random read per edge on this host: "
                f"{_fmt(ex.get('host_random_read_per_edge'), 2)}",
            }
        )
    return out


def _repeats_note(p: dict[str, Any]) -> str:
    """The other runs' seconds where a size was partitioned several times (the row is the median)."""
    runs = p.get("repeats_seconds") or []
    if len(runs) < 2:
        return ""
    return " (median of " + " / ".join(f"{x:.1f}" for x in runs) + ")"


def _forked_note(p: dict[str, Any]) -> str:
    """How a partition's peak was bounded where the planner forked its orderings."""
    if not p.get("forked_peak_mib"):
        return ""
    return (
        f" (bound with the forked orderings: this process {p['process_peak_rss_mib']:.0f} MiB, "
        f"with the children at once {p['forked_peak_mib']:.0f})"
    )


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(report: dict[str, Any], png: str | None) -> str:
    from common import MALLOC_ENVS

    a = report["analysis"]
    malloc = report["config"].get("malloc", "default")  # reports before --malloc ran with the defaults
    lines = [
        f"# Scale: products-like graph up to {max(s['nodes'] for s in report['sizes']):,} nodes",
        "",
        f"`{report['command']}` — {report['created']}, {report['host']['cpus']} CPUs, torch "
        f"{report['host']['torch']}; hidden {report['config']['hidden']}, {report['config']['layers']} layers, "
        f"{report['config']['warmup']} warm-up + {report['config']['epochs']} measured epochs, no link "
        "emulation, one thread per rank; adaqp's bits assigned at epoch "
        # reports before --first-assign assigned at every warm-up's end
        f"{report['config'].get('first_assign', max(1, report['config']['warmup']))} and every "
        f"{report['config'].get('assign_every', max(1, report['config']['warmup']))} epochs after. "
        "Load averages (1/5/15 min) are recorded with every measurement.",
        "",
        f"Allocator environment of every process (`--malloc {malloc}`): "
        + (" ".join(f"`{k}={v}`" for k, v in MALLOC_ENVS[malloc].items()) or "glibc's and torch's defaults")
        + ".",
        "",
    ]
    if png:
        lines += [f"![scale]({png})", ""]
    lines += [
        "## Graph generation",
        "",
        "| nodes | edges (directed) | time s | peak RSS MiB (above import) | graph MiB "
        "| mean / median / max degree | homophily | train / val / test | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["sizes"]:
        g = s["generate"]
        lines.append(
            f"| {g['nodes']:,} | {g['edges']:,} | {g['seconds']:.1f} | {g['peak_rss_mib']:.0f} "
            f"({g['peak_above_import_mib']:.0f}) | {g['graph_mib']:.0f} | {g['degree_mean']:.1f} / "
            f"{g['degree_median']:.0f} / {g['degree_max']:,} | {g['homophily']:.3f} | {g['train']:,} / "
            f"{g['val']:,} / {g['test']:,} | {' '.join(f'{x:.1f}' for x in g['load'])} |"
        )
    lines += [
        "",
        "## Partitioning (`lightning_fullgraph partition --num-parts "
        f"{report['config']['scale_ranks']}`, METIS included; the parts' METIS orderings run in forked "
        "children, as many at once as the process has CPUs, and the peak is the larger of the process's own "
        "and the bound with those children: the process's mark after planning plus the children's private peaks)",
        "",
        "Host read: nanoseconds per read of an `[N]` int64 table at random positions and at "
        "ascending ones (one thread, median of 5 passes of up to 2^24 reads, in the partitioner's "
        "allocator environment): what one lookup by node id costs at this size when ids carry no "
        "locality (the generated graph hides its structure from its ids), against a streaming pass. "
        "Its exponent below (`host_random_read_per_edge`, one such read per edge) is this host's "
        "own growth for a random-access bound linear-time pass.",
        "",
        "| nodes | total s (generation included) | generate s | METIS s | plan s | write s | peak RSS MiB (after imports) | "
        "above imports / graph | METIS edges | halo total (fraction of N) | cache reuse s | "
        "host read ns, random / ascending | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["sizes"]:
        p, ph = s["partition"], s["partition"]["phase_seconds"]
        reuse = s.get("partition_reuse") or {}
        halo = s.get("total_halo")
        lines.append(
            f"| {s['nodes']:,} | {p['partition_seconds']:.1f}{_repeats_note(p)} | {ph.get('load', 0):.1f} | "
            f"{ph.get('metis', 0):.1f} | {ph.get('plan', 0):.1f} | {ph.get('write', 0):.1f} | {p['peak_rss_mib']:.0f} "
            f"({p.get('baseline_rss_mib', 0):.0f}) | {(p['peak_rss_mib'] - p.get('baseline_rss_mib', 0)) / p['graph_mib']:.2f}"
            f" | {_fmt(p.get('metis_max_edges')) if p.get('metis_max_edges') else 'all'} | "
            f"{_fmt(halo)} ({(halo or 0) / s['nodes']:.2f}) | "
            f"{_fmt(reuse.get('total_seconds'), 2)} ({'hit' if reuse.get('cache_hit') else 'MISS'}) | "
            + (f"{gather['random_ns']:.1f} / {gather['ascending_ns']:.1f}" if (gather := s.get("gather")) else "-")
            + f" | {' '.join(f'{x:.1f}' for x in p['load_before'])} |"
        )
    lines += [
        "",
        "## Training",
        "",
        "Epoch time: median of the measured epochs (slowest rank per epoch). Peak: the "
        "largest rank's peak RSS (VmHWM) and the same above its import baseline (torch, Lightning, PyG, "
        "process group, model). Halo: rows received per exchange by the rank with the most. CPU: a "
        "rank's user + kernel seconds per epoch (mean over ranks; 4 ranks share 2 cores, so an epoch "
        "takes about twice that); faults: minor page faults per epoch per local edge (fresh pages "
        "the kernel zeroes for large temporaries; glibc returns allocations above 32 MiB to the kernel "
        "when they are freed, so only large ranks pay them every epoch).",
        "",
        "| nodes | ranks | conv | mode | epoch s | peak RSS MiB/rank | above baseline MiB | halo rows max | "
        "CPU s (kernel %) | faults / edge | wall s | load before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(report["runs"], key=lambda r: (r["nodes"], r["ranks"], r["conv"], r["mode"])):
        s = r.get("summary")
        if not s:
            lines.append(
                f"| {r['nodes']:,} | {r['ranks']} | {r['conv']} | {r['mode']} | FAILED: "
                f"{str(r.get('error'))[:120]} | | | | | | | |"
            )
            continue
        cpu = s.get("cpu") or {}
        user, kernel, faults = cpu.get("cpu_user"), cpu.get("cpu_sys"), cpu.get("minor_faults")
        local_edges = (s.get("partition") or {}).get("edges_mean")
        cpu_cell = f"{user + kernel:.1f} ({100 * kernel / (user + kernel):.0f} %)" if user and kernel else "–"
        fault_cell = f"{faults / local_edges:.3f}" if faults and local_edges else "–"
        lines.append(
            f"| {r['nodes']:,} | {r['ranks']} | {r['conv']} | {r['mode']} | {s['epoch_time']:.2f} | "
            f"{_mem(r, 'peak_rss_max'):.0f} | {_mem(r, 'peak_above_baseline_max'):.0f} | "
            f"{_fmt((s.get('partition') or {}).get('halo_max'))} | {cpu_cell} | {fault_cell} | {r['wall_s']:.0f} | "
            f"{' '.join(f'{x:.1f}' for x in r['load_before'])} |"
        )
    lines += [
        "",
        "## Fitted exponents (least squares on log-log, x = directed edges)",
        "",
        "| quantity | exponent |",
        "|---|---|",
    ]
    for k, v in a["exponents"].items():
        lines.append(f"| {k} | {_fmt(v, 2)} |")
    lines += ["", "## Goals", "", "| goal | value | limit | met | detail |", "|---|---|---|---|---|"]
    for g in a["goals"]:
        lines.append(
            f"| {g['what']} | {_fmt(g['value'], 2)} | {_fmt(g['limit'], 2)} | "
            f"{'yes' if g['ok'] else '**no**'} | {g['detail']} |"
        )
    if report.get("merged"):
        lines += ["", "Merged from: " + "; ".join(f"`{c}`" for c in report["merged"])]
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = report["sizes"]
    parts = report["config"]["scale_ranks"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    ax = axes[0]
    e = [s["partition"]["num_edges"] for s in sizes]
    ax.loglog(
        e, [s["partition"]["partition_seconds"] for s in sizes], "k-o", label="partition (METIS+plan+write)"
    )
    ax.loglog(e, [s["generate"]["seconds"] for s in sizes], "k--s", label="generation")
    for conv, mode in sorted({(r["conv"], r["mode"]) for r in report["runs"] if r["ranks"] == parts}):
        pts = sorted(
            (r["graph_edges"], r["summary"]["epoch_time"])
            for r in report["runs"]
            if r["conv"] == conv and r["mode"] == mode and r["ranks"] == parts and r.get("summary")
        )
        if pts:
            ax.loglog(*zip(*pts, strict=True), "-^", label=f"epoch {conv} {mode} @{parts}")
    ax.set_xlabel("directed edges")
    ax.set_ylabel("seconds")
    ax.set_title("time")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    ax.loglog(
        e,
        [s["partition"]["peak_rss_mib"] - s["partition"].get("baseline_rss_mib", 0.0) for s in sizes],
        "k-o",
        label="partition peak above imports",
    )
    ax.loglog(e, [s["partition"]["graph_mib"] for s in sizes], "k:", label="graph size")
    ax.loglog(e, [3 * s["partition"]["graph_mib"] for s in sizes], "r:", label="3x graph (goal)")
    for conv, mode in sorted({(r["conv"], r["mode"]) for r in report["runs"]}):
        for ranks in sorted({r["ranks"] for r in report["runs"]}):
            pts = sorted(
                (r["graph_edges"], _mem(r, "peak_above_baseline_max"))
                for r in report["runs"]
                if r["conv"] == conv and r["mode"] == mode and r["ranks"] == ranks and r.get("summary")
            )
            if pts:
                ax.loglog(
                    *zip(*pts, strict=True),
                    "-^" if ranks > 1 else "--x",
                    label=f"rank peak above baseline {conv} {mode} @{ranks}",
                )
    ax.set_xlabel("directed edges")
    ax.set_ylabel("MiB")
    ax.set_title("memory")
    ax.legend(fontsize=6)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(report: dict[str, Any], out_dir: Path, name: str) -> None:
    report["analysis"] = analyse(report)
    png = out_dir / f"{name}.png"
    has_png = plot(report, str(png))
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / f"{name}.md").write_text(markdown(report, png.name if has_png else None))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        for extra in args.merge:
            other = json.loads(Path(extra).read_text())
            # a size the other report partitioned afresh (not a cache hit) replaces ours
            have = {s["nodes"] for s in report["sizes"]}
            theirs = {
                s["nodes"]: s
                for s in other["sizes"]
                if not s["partition"]["cache_hit"] or s["nodes"] not in have
            }
            report["sizes"] = [s for s in report["sizes"] if s["nodes"] not in theirs] + list(theirs.values())
            report["sizes"].sort(key=lambda s: s["nodes"])
            key = ("nodes", "ranks", "conv", "mode")
            done = {tuple(r[k] for k in key) for r in report["runs"] if r.get("summary")}
            report["runs"] = [
                r
                for r in report["runs"]
                if tuple(r[k] for k in key)
                not in {tuple(o[k] for k in key) for o in other["runs"] if o.get("summary")}
            ]
            report["runs"] += [
                r for r in other["runs"] if r.get("summary") or tuple(r[k] for k in key) not in done
            ]
            report["notes"] = [
                n
                for n in report["notes"]
                if not any(
                    n.startswith(f"{r['nodes']} nodes, {r['conv']} {r['mode']} @{r['ranks']}")
                    for r in other["runs"]
                    if r.get("summary")
                )
            ] + other.get("notes", [])
            report.setdefault("merged", []).append(other["command"])
        write(report, Path(args.render).parent, Path(args.render).stem)
        print(f"rendered {args.render}")
        return 0
    import torch

    cache = Path(args.cache_dir)
    run_root = cache / "runs" / args.name
    logs = cache / "scale" / args.name
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "name": args.name,
        "created": datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/run.py " + shlex.join(argv),
        "config": {
            k: getattr(args, k)
            for k in (
                "scale_nodes",
                "scale_ranks",
                "scale_modes",
                "scale_convs",
                "scale_single",
                "full_convs",
                "hidden",
                "layers",
                "warmup",
                "epochs",
                "assign_every",
                "first_assign",
                "staleness",
                "seed",
                "metis_fraction",
                "malloc",
                "partition_repeats",
            )
        },
        "host": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "load_before": _load(),
        },
        "graph_features": 100,
        "sizes": [],
        "runs": [],
        "notes": [],
    }
    partial = out_dir / f"{args.name}.partial.json"
    index = 0
    started = time.perf_counter()
    for n in args.nodes_list:
        print(f"[scale] {n} nodes: generating ...", flush=True)
        size: dict[str, Any] = {"nodes": n, "generate": generate(n, args.seed, logs / f"gen-{n}.log", args.malloc)}
        g = size["generate"]
        print(
            f"[scale]   {g['edges']:,} edges in {g['seconds']:.1f}s, peak {g['peak_rss_mib']:.0f} MiB; "
            f"partitioning into {args.scale_ranks} ...",
            flush=True,
        )
        bound = round(args.metis_fraction * g["edges"] / 2) if args.metis_fraction > 0 else None
        size["partition"] = partition(
            n, args.scale_ranks, cache / "partitions", logs / f"part-{n}.log", bound, args.malloc
        )
        if args.partition_repeats > 1:
            size["partition"] = _median_partition(args, n, size["partition"], cache, logs, bound)
        size["partition_reuse"] = partition(
            n, args.scale_ranks, cache / "partitions", logs / f"part-{n}-again.log", bound, args.malloc
        )
        size["gather"] = gather_calibration(n, g["edges"], args.malloc)
        manifest = json.loads((Path(size["partition"]["folder"]) / "manifest.json").read_text())
        size["total_halo"] = manifest.get("total_halo")
        p = size["partition"]
        print(
            f"[scale]   partition {p['partition_seconds']:.1f}s, peak {p['peak_rss_mib']:.0f} MiB "
            f"({(p['peak_rss_mib'] - p['baseline_rss_mib']) / p['graph_mib']:.2f}x graph above imports), reuse "
            f"{size['partition_reuse']['total_seconds']:.2f}s",
            flush=True,
        )
        report["sizes"].append(size)
        convs = args.full_convs_list if n == max(args.nodes_list) else args.convs_list
        plan = [(c, m, args.scale_ranks, p["folder"]) for c in convs for m in args.modes_list]
        if n in args.single_list:
            single = partition(n, 1, cache / "partitions", logs / f"part-{n}-p1.log", None, args.malloc)
            plan += [(c, "exact", 1, single["folder"]) for c in args.convs_list]
        for conv, mode, ranks, folder in plan:
            skip = memory_guard(report["runs"], conv, mode, ranks, p["num_edges"])
            if skip:
                report["notes"].append(f"{n} nodes, {conv} {mode} @{ranks} not run: {skip}")
                print(f"[scale]   {conv} {mode} @{ranks}: SKIPPED ({skip})", flush=True)
                continue
            rec = train(args, conv, mode, ranks, folder, n, index, run_root)
            index += 1
            rec["graph_edges"] = p["num_edges"]
            report["runs"].append(rec)
            s = rec.get("summary")
            print(
                f"[scale]   {conv} {mode} @{ranks}: "
                + (
                    f"epoch {s['epoch_time']:.2f}s, peak {_mem(rec, 'peak_rss_max'):.0f} MiB/rank "
                    f"({_mem(rec, 'peak_above_baseline_max'):.0f} above baseline) [{rec['wall_s']:.0f}s wall, load "
                    f"{rec['load_before']}]"
                    if s
                    else f"FAILED {rec.get('error')}"
                ),
                flush=True,
            )
            partial.write_text(json.dumps(report, indent=1, default=str))
    report["host"]["load_after"] = _load()
    report["total_wall_s"] = time.perf_counter() - started
    write(report, out_dir, args.name)
    partial.unlink(missing_ok=True)
    print((out_dir / f"{args.name}.md").read_text())
    return 0
