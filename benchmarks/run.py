"""Throughput, traffic, memory and accuracy of every mode, side by side, on emulated links.

One invocation runs the modes ``exact``, ``adaqp``, ``sylvie`` and ``compute-only``
(``FullGraphStrategy(mode="exact", compute_only=True)``: no halo transfer at all, the bound
compression aims at) on the same graph, model and partitions at every rank count, plus a
scaling sweep (exact mode, ranks x graph sizes) and optional accuracy runs, and writes
``<out>/<name>.json``, ``<out>/<name>.md`` and ``<out>/<name>.png``::

    python benchmarks/run.py --quick                   # < 5 min on 2 cores
    python benchmarks/run.py --full                    # the issue's goal configuration
    python benchmarks/run.py --graph tolokers --ranks 4 --link 1gbit --name tolokers-1g
    python benchmarks/run.py --graph community --nodes 300000 --ranks 2,4 --link 10gbit
    python benchmarks/run.py --render benchmarks/results/quick.json   # redraw .md/.png only

Every configuration runs in a fresh ``python benchmarks/run.py --worker SPEC`` process that
launches the Lightning Trainer (CPU, gloo, ``start_method="fork"``, one thread per rank).  With
``--link 1gbit|10gbit`` that process runs in a fresh network namespace (``unshare -n``) whose
loopback, the only interface there, is throttled by a token bucket (``tc ... tbf``): all halo
traffic, gradient all-reduces and rendezvous go through it.  See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # run from a checkout: `python benchmarks/run.py`
SHARED = Path(os.environ.get("LIGHTNING_FULLGRAPH_SHARED", REPO.parent / "shared")) / "datasets"
MODES = ("exact", "adaqp", "sylvie", "compute-only")
# extra variants for diagnosis (not run by default): adaqp without central/marginal overlap, and
# the compute-only bound of the overlap code path adaqp uses
VARIANTS = ("adaqp-nooverlap", "exact-overlap", "compute-only-overlap")
# rate, token-bucket burst: burst >= rate / HZ and >= the loopback MTU (64 KiB)
LINKS = {"1gbit": (1e9, "1gbit", "1mbit"), "10gbit": (1e10, "10gbit", "10mbit")}

PRESETS: dict[str, dict[str, Any]] = {
    # small graph, every mode at 2 and 4 ranks on a 1 Gbit/s link, a scaling sweep on two
    # small sizes, Cora accuracy at 4 ranks: < 5 minutes on 2 cores
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
    graph="community", nodes=100_000, hidden=256, ranks="2,4", link="1gbit", warmup=5, epochs=5,
    scaling_nodes="", scaling_ranks="1,2,4", scaling_epochs=4, accuracy="", accuracy_ranks="2,4",
    accuracy_epochs=100, repeat=1,
)


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="small preset, < 5 minutes on 2 cores")
    preset.add_argument("--full", action="store_true",
                        help="the issue's goal configuration (1 Gbit/s, 4 ranks, hidden 256, tolokers)")
    preset.add_argument("--accuracy-preset", action="store_true", dest="accuracy_preset",
                        help="test accuracy of exact/adaqp/sylvie on Cora, hidden 256, 100 epochs, 2 and 4 ranks")
    preset.add_argument("--scaling", action="store_true",
                        help="scaling sweep only: community 10^4/3*10^4/10^5 nodes at 1, 2, 4 ranks (exact)")
    p.add_argument("--name", help="results file stem (default: the preset's name, else 'bench')")
    p.add_argument("--out-dir", default=str(BENCH_DIR / "results"), help="where <name>.json/.md/.png go")
    p.add_argument("--graph", choices=("community", "tolokers", "cora"), help="graph of the main comparison")
    p.add_argument("--nodes", type=int, help="nodes of the generated community graph, 10^4 .. 10^6 (default 10^5)")
    p.add_argument("--conv", choices=("gcn", "sage"), default="gcn")
    p.add_argument("--hidden", type=int, help="hidden width (default 256; --quick: 128)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--ranks", help="comma-separated rank counts of the main comparison (default 2,4; '' = none)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)} (variants: {','.join(VARIANTS)})")
    p.add_argument("--link", choices=("1gbit", "10gbit", "none"), help="emulated link (default 1gbit)")
    p.add_argument(
        "--link-scope", choices=("shared", "per-rank"), default="shared",
        help="shared: ONE token bucket of the link's rate for all ranks together (every byte of every "
        "rank crosses the same throttled loopback); per-rank: the bucket's rate is the link rate x ranks, "
        "what a switch with one full-duplex link per rank gives balanced all-to-all traffic",
    )
    p.add_argument("--fallback-none", action="store_true",
                   help="if unshare/tc are unavailable, run unthrottled (loudly flagged in the report) instead of failing")
    p.add_argument("--warmup", type=int, help="warm-up epochs, not measured (default 5)")
    p.add_argument("--epochs", type=int, help="measured epochs after the warm-up (default 5)")
    p.add_argument("--staleness", type=int, default=5, help="sylvie: every staleness-th epoch is synchronous")
    p.add_argument("--assign-every", type=int,
                   help="adaqp: epochs between bit-width assignments (default: the warm-up, so the first "
                   "assignment is the first measured epoch)")
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
        "--malloc", choices=("default", "no-mmap"), default="default",
        help="no-mmap: run the ranks with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge> (glibc), so that big "
        "tensors are recycled from the heap instead of being mmap-ed and page-faulted in afresh at every "
        "allocation (on CPU that is up to half of the compute time, see README)",
    )
    p.add_argument("--repeat", type=int,
                   help="rounds of the mode comparison (alternating order); measured epochs are pooled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before one configuration is killed")
    p.add_argument("--cache-dir", default=str(BENCH_DIR / ".cache"), help="partitions and dataset cache")
    p.add_argument("--keep-going", action="store_true", help="record a failed configuration and continue")
    args = p.parse_args(argv)
    preset_name = "quick" if args.quick else "full" if args.full else "scaling" if args.scaling else "accuracy" if args.accuracy_preset else None
    values = dict(DEFAULTS, **(PRESETS[preset_name] if preset_name else {}))
    for key, value in values.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.name = args.name or preset_name or "bench"
    args.preset = preset_name
    if args.no_scaling:
        args.scaling_nodes = ""
    args.modes_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(args.modes_list) - set(MODES) - set(VARIANTS))
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {MODES + VARIANTS}")
    if args.assign_every is None:
        args.assign_every = max(1, args.warmup)
    return args


def _ints(text: str) -> list[int]:
    return [int(float(t)) for t in str(text).split(",") if t.strip()]


# -- link emulation ----------------------------------------------------------------------------
def link_wrapper(link: str, scope: str, ranks: int) -> tuple[list[str], str]:
    """The command prefix that runs a worker behind the emulated link, and its description."""
    if link == "none":
        return [], "no throttling (host loopback)"
    rate, _, burst = LINKS[link]
    factor = ranks if scope == "per-rank" else 1
    rate_bits = int(rate * factor)
    burst_bytes = int(float(burst.removesuffix("mbit")) * 1e6 / 8 * factor)
    qdisc = f"tbf rate {rate_bits}bit burst {burst_bytes}b latency 50ms"
    script = (
        "set -e; ip link set lo up; tc qdisc add dev lo root " + qdisc + "; set +e; "
        '"$@"; rc=$?; tc -s qdisc show dev lo > "$BENCH_TC_STATS" 2>&1; exit $rc'
    )
    desc = (f"{link}, {scope}: tc {qdisc} on the loopback of a private network namespace"
            + (f" ({ranks} x {link})" if factor > 1 else " (one bucket for all ranks' traffic)"))
    return ["unshare", "-n", "bash", "-c", script, "bench-link"], desc


def check_link_support() -> str | None:
    """None if ``unshare -n`` + ``tc tbf`` work here, else why not."""
    for tool in ("unshare", "tc", "ip", "bash"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH"
    cmd = ["unshare", "-n", "bash", "-c",
           "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 1mbit latency 50ms"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{shlex.join(cmd)} failed: {exc}"
    if proc.returncode:
        return (f"{shlex.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()} (needs root or "
                "CAP_NET_ADMIN + CAP_SYS_ADMIN, and the sch_tbf kernel module)")
    return None


def parse_tc_stats(text: str) -> dict[str, int]:
    """``Sent N bytes M pkt (dropped D, overlimits O requeues R)`` of the root qdisc."""
    import re

    m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
    if not m:
        return {}
    return dict(zip(("bytes", "packets", "dropped", "overlimits"), map(int, m.groups())))


# -- graphs and partitions -----------------------------------------------------------------
def load_graph(kind: str, nodes: int, cache_dir: Path, seed: int):
    from lightning_fullgraph.datasets import community_graph, load_dataset

    if kind == "community":
        size = f"{nodes / 1e6:g}M" if nodes >= 10**6 else f"{nodes / 1e3:g}k" if nodes >= 1000 else str(nodes)
        return community_graph(num_nodes=nodes, seed=seed), f"community-{nodes}", f"community {size}"
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
    raise ValueError(kind)


_LOADED: dict[tuple[str, int], Any] = {}


def prepare_graph(kind: str, nodes: int, parts: list[int], cache_dir: Path, seed: int) -> dict[str, Any]:
    """Loads the graph once, METIS-partitions it for every rank count (cached)."""
    from lightning_fullgraph.partition.cache import ensure_partitions

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
    for k in sorted(set(parts)):
        result = ensure_partitions(data, k, method="metis", seed=seed, cache_root=cache_dir / "partitions")
        info["partitions"][str(k)] = {"folder": str(result.folder), "rebuilt": result.rebuilt,
                                      "seconds": getattr(result, "seconds", None)}
    return info


# -- one configuration -----------------------------------------------------------------------
def run_config(args: argparse.Namespace, section: str, graph: dict[str, Any], mode: str, ranks: int,
               warmup: int, epochs: int, test: bool, run_root: Path, index: int, repeat: int = 0) -> dict[str, Any]:
    tag = f"{section}-{graph['key']}-{mode}-r{ranks}" + (f"-rep{repeat}" if repeat else "")
    run_dir = run_root / tag
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    strategy_kwargs: dict[str, Any] = {"seed": args.seed}
    if mode.startswith("adaqp"):
        strategy_kwargs.update(assign_every=args.assign_every, link_costs=args.link_costs)
    if mode == "sylvie":
        strategy_kwargs.update(staleness=args.staleness)
    spec = {
        "mode": mode, "ranks": ranks, "epochs": warmup + epochs, "warmup": warmup, "conv": args.conv,
        "hidden": args.hidden, "layers": args.layers, "in_channels": graph["features"],
        "num_classes": graph["classes"], "partition_folder": graph["partitions"][str(ranks)]["folder"],
        "strategy_kwargs": strategy_kwargs, "test": test, "seed": args.seed, "threads": 1,
        "pg_timeout": max(60.0, args.timeout / 2), "run_dir": str(run_dir),
        "result_path": str(run_dir / "result.json"),
    }
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    prefix, _ = link_wrapper(args.link, args.link_scope, ranks)
    cmd = prefix + [sys.executable, str(BENCH_DIR / "run.py"), "--worker", str(run_dir / "spec.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port(index, args.link)), GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", BENCH_TC_STATS=str(run_dir / "tc_stats.txt"),
        PYTHONPATH=os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        PYTHONWARNINGS="ignore",
    )
    if args.malloc == "no-mmap":
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    record: dict[str, Any] = {
        "section": section, "graph_key": graph["key"], "graph_label": graph["label"], "graph_nodes": graph["nodes"],
        "mode": mode, "ranks": ranks, "warmup": warmup, "epochs": epochs, "run_dir": str(run_dir),
        "command": shlex.join(cmd),
        "link_rate_bps": None if args.link == "none" else LINKS[args.link][0] * (ranks if args.link_scope == "per-rank" else 1),
    }
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and its ranks
            proc.wait()
            rc = None
    record["wall_s"] = time.perf_counter() - t0
    tc = run_dir / "tc_stats.txt"
    if tc.is_file():
        record["tc"] = parse_tc_stats(tc.read_text())
    result_path = run_dir / "result.json"
    if rc != 0 or not result_path.is_file():
        tail = (run_dir / "log.txt").read_text(errors="replace").strip().splitlines()[-15:]
        why = "timed out" if rc is None else f"exit status {rc}"
        record["error"] = f"{why}; log {run_dir / 'log.txt'}: " + " / ".join(tail[-3:])
        if not args.keep_going:
            raise SystemExit(f"configuration {tag} failed ({why}); last lines of {run_dir / 'log.txt'}:\n" + "\n".join(tail))
        return record
    from bench_report import summarize

    result = json.loads(result_path.read_text())
    record["test_acc"] = result.get("test_acc")
    record["fit_wall_s"] = result.get("fit_wall")
    record["logged_last_epoch"] = {k: v for k, v in result.get("logged_last_epoch", {}).items() if k.startswith("comm/")}
    record["summary"] = summarize(result, warmup)
    record["_result"] = result  # merged with repeats, then dropped
    record["ranks_detail"] = [{"rank": r["rank"], "memory": r["memory"], "partition": r["partition"]} for r in result["ranks"]]
    return record


def merge_repeats(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per configuration: repeats pooled (their measured epochs together)."""
    from bench_report import summarize

    merged: dict[tuple, list[dict[str, Any]]] = {}
    for rec in runs:
        merged.setdefault((rec["section"], rec["graph_key"], rec["mode"], rec["ranks"]), []).append(rec)
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
                rec["summary"] = summarize([r["_result"] for r in ok], rec["warmup"])
                accs = [r["test_acc"] for r in ok if r.get("test_acc") is not None]
                rec["test_acc"] = statistics.fmean(accs) if accs else None
            errors = [r["error"] for r in recs if r.get("error")]
            if errors:
                rec["error"] = f"{len(errors)} of {len(recs)} repeats failed: " + errors[0]
        out.append(rec)
    for rec in out:
        rec.pop("_result", None)
    return out


def _port(index: int, link: str) -> int:
    if link != "none":
        return 29500 + index % 1000  # a private namespace: every port is free
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


def _progress(rec: dict[str, Any]) -> None:
    s = rec.get("summary")
    if s is None:
        print(f"  {rec['section']:8s} {rec['graph_label']:16s} {rec['mode']:12s} @{rec['ranks']}: FAILED {rec.get('error')}", flush=True)
        return
    acc = f" acc {rec['test_acc']:.4f}" if rec.get("test_acc") is not None else ""
    mb = (s["bytes_sent"] or 0) / 1e6
    print(f"  {rec['section']:8s} {rec['graph_label']:16s} {rec['mode']:12s} @{rec['ranks']}: epoch "
          f"{s['epoch_time']:.3f}s (mean {s['epoch_time_mean']:.3f}) {mb:.2f} MB/epoch, peak "
          f"{s['memory']['peak_rss_max']:.0f} MiB/rank{acc} [{rec['wall_s']:.0f}s wall]", flush=True)


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        from bench_worker import main as worker_main

        return worker_main(argv[1])
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
    import torch

    torch.set_num_threads(1)
    print(f"[{args.name}] preparing graphs and partitions ...", flush=True)
    graphs: dict[str, dict[str, Any]] = {}

    def graph(kind: str, nodes: int, parts: list[int]) -> dict[str, Any]:
        info = prepare_graph(kind, nodes, parts, cache_dir, args.seed)
        if info["key"] in graphs:
            graphs[info["key"]]["partitions"].update(info["partitions"])
        else:
            graphs[info["key"]] = info
        return graphs[info["key"]]

    main_graph = graph(args.graph, args.nodes, main_ranks) if main_ranks else None
    scaling_graphs = [graph("community", n, scaling_ranks) for n in scaling_nodes]
    acc_graph = graph(args.accuracy, args.nodes, acc_ranks) if args.accuracy else None
    _, link_desc = link_wrapper(args.link, args.link_scope, max(main_ranks + scaling_ranks + acc_ranks + [1]))
    plan: list[tuple] = []
    for r in main_ranks:
        for mode in args.modes_list:
            plan.append(("main", main_graph, mode, r, args.warmup, args.epochs, args.graph == "cora"))
    for g in scaling_graphs:
        for r in scaling_ranks:
            if g is main_graph and r in main_ranks and "exact" in args.modes_list:
                continue  # the main comparison's exact run is this point
            plan.append(("scaling", g, "exact", r, 1, args.scaling_epochs, False))
    if acc_graph is not None:
        for r in acc_ranks:
            for mode in args.modes_list:
                if not mode.startswith("compute-only"):
                    # trains every epoch; the summary (traffic, time) skips the first few
                    plan.append(("accuracy", acc_graph, mode, r, min(5, args.accuracy_epochs // 2),
                                 args.accuracy_epochs - min(5, args.accuracy_epochs // 2), True))
    print(f"[{args.name}] {len(plan)} configurations, link: {link_desc}", flush=True)
    main_plan = [c for c in plan if c[0] == "main"]
    for k in range(1, args.repeat):
        # repeats of the mode comparison, in reverse order every other round, so that a drift in
        # the host's load does not favour the modes that happen to run first
        plan += [(*c, k) for c in (main_plan[::-1] if k % 2 else main_plan)]
    plan = [c if len(c) == 8 else (*c, 0) for c in plan]
    print(f"[{args.name}] {len(plan)} runs ({args.repeat} round(s) of the mode comparison)", flush=True)
    load_before = _load()
    runs = []
    for i, (section, g, mode, r, w, e, test, repeat) in enumerate(plan):
        rec = run_config(args, section, g, mode, r, w, e, test, run_root, i, repeat)
        _progress(rec)
        runs.append(rec)
    runs = merge_repeats(runs)
    report = {
        "name": args.name,
        "created": datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/run.py " + shlex.join(argv),
        "config": {k: getattr(args, k) for k in (
            "preset", "graph", "nodes", "conv", "hidden", "layers", "ranks", "modes", "link", "link_scope",
            "warmup", "epochs", "staleness", "assign_every", "link_costs", "scaling_nodes", "scaling_ranks",
            "scaling_epochs", "accuracy", "accuracy_ranks", "accuracy_epochs", "malloc", "repeat", "seed")},
        "link": {"name": args.link, "scope": args.link_scope, "description": link_desc},
        "host": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": _load(),
                 "python": sys.version.split()[0], "torch": torch.__version__, "threads_per_rank": 1},
        "graphs": graphs,
        "warnings": warnings,
        "runs": runs,
        "total_wall_s": time.perf_counter() - started,
    }
    from bench_report import markdown, plot

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

