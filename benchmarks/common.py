"""What run.py and the bench_* scripts share: allocator environments, link emulation, one configuration run.

``run.py`` and ``bench_scale.py`` run a configuration (:func:`config`, :func:`run_config`) in a
fresh ``run.py --worker`` process, with the allocator environment of :data:`MALLOC_ENVS` and
behind the emulated link of :func:`link_wrapper`; ``bench_convergence.py`` uses the link
emulation too.  Nothing here imports ``run.py`` or a ``bench_*`` module at import time (the
benchmarks import without a cycle)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
SHARED = Path(os.environ.get("LIGHTNING_FULLGRAPH_SHARED", REPO.parent / "shared")) / "datasets"

# The ranks' allocator environment (``--malloc``); every run records which one it had.
MALLOC_ENVS: dict[str, dict[str, str]] = {
    "default": {},
    "no-mmap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": "2097152"},
}
# The low-locality graph of the convergence study (and tests/integration/test_convergence.py):
# 16 planted communities, two thirds of the edges between random nodes and weak features, so
# that METIS finds little locality: halo rows are 54.6 % of the aggregation inputs at 4 parts.
LOWLOC_GRAPH: dict[str, Any] = dict(num_nodes=12000, num_classes=16, homophily=0.45, avg_degree=24, feature_noise=1.0,
                                    train_per_class=100, num_val=2000, num_test=2000, seed=0)


def lowloc_graph():
    """The low-locality graph (:data:`LOWLOC_GRAPH`), a PyG ``Data``."""
    from lightning_fullgraph.data.datasets import community_graph

    return community_graph(**LOWLOC_GRAPH)


# rate, token-bucket burst: burst >= rate / HZ and >= the loopback MTU (64 KiB)
LINKS = {"1gbit": (1e9, "1gbit", "1mbit"), "10gbit": (1e10, "10gbit", "10mbit")}
MIN_BURST_BYTES = 2 * 65536  # a calibrated (slow) link's bucket still holds two loopback packets


# -- link emulation ----------------------------------------------------------------------------
def parse_rate(text: str) -> float:
    """``200mbit``, ``1.5gbit``, ``800kbit``, ``2e8`` (bit/s) -> bit/s."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kmg]?)(bit|bps)?\s*", str(text).lower())
    if not m:
        raise SystemExit(f"--link-rate {text!r}: give bit/s, e.g. 200mbit or 2e8")
    return float(m.group(1)) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def link_wrapper(link: str, scope: str, ranks: int, rate_bps: float | None = None) -> tuple[list[str], str]:
    """The command prefix that runs a worker behind the emulated link, and its description.

    ``link`` is ``1gbit``/``10gbit`` (their table rate) or ``calibrated`` (``rate_bps``, bit/s
    per link); with ``scope="per-rank"`` the bucket carries ``ranks x`` the link rate."""
    if link == "none":
        return [], "no throttling (host loopback)"
    factor = ranks if scope == "per-rank" else 1
    if link in LINKS:
        rate, _, burst = LINKS[link]
        burst_bytes = int(float(burst.removesuffix("mbit")) * 1e6 / 8 * factor)
        name = link
    else:
        if not rate_bps or rate_bps <= 0:
            raise ValueError(f"link {link!r} needs a positive rate_bps")
        rate = float(rate_bps)
        # 1 ms of traffic (as the table's links) but at least two loopback packets
        burst_bytes = int(max(rate / 8 / 1000, MIN_BURST_BYTES) * factor)
        name = f"{link} {rate / 1e6:.1f} Mbit/s"
    rate_bits = int(rate * factor)
    qdisc = f"tbf rate {rate_bits}bit burst {burst_bytes}b latency 50ms"
    script = (
        "set -e; ip link set lo up; tc qdisc add dev lo root " + qdisc + "; set +e; "
        '"$@"; rc=$?; tc -s qdisc show dev lo > "$BENCH_TC_STATS" 2>&1; exit $rc'
    )
    desc = (f"{name}, {scope}: tc {qdisc} on the loopback of a private network namespace"
            + (f" ({ranks} x {name})" if factor > 1 else " (one bucket for all ranks' traffic)"))
    return ["unshare", "-n", "bash", "-c", script, "bench-link"], desc


def link_rate(link: str, rate_bps: float | None = None) -> float | None:
    """Per-link rate in bit/s (None: unthrottled)."""
    if link == "none":
        return None
    return LINKS[link][0] if link in LINKS else rate_bps


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
    m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
    if not m:
        return {}
    return dict(zip(("bytes", "packets", "dropped", "overlimits"), map(int, m.groups())))


def run_logged(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int | None, float]:
    """Runs ``cmd`` in its own session with output to ``log_path``; kills the whole session
    (the worker and its ranks) after ``timeout`` s.  Returns (exit status or None, wall s)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.perf_counter() - t0



def part_key(ranks: int, balance: str | None) -> str:
    """Key of a partition in ``graph["partitions"]``: ``"4"`` (the partitioner's default
    balance) or ``"4-nodes"``."""
    return str(ranks) if not balance else f"{ranks}-{balance}"


# -- one configuration -----------------------------------------------------------------------
def config(section: str, graph: dict[str, Any], mode: str, ranks: int, warmup: int, epochs: int, test: bool, *,
           link: str, scope: str, rate_bps: float | None = None, balance: str | None = None, group: str = "",
           repeat: int = 0) -> dict[str, Any]:
    return dict(section=section, graph=graph, mode=mode, ranks=ranks, warmup=warmup, epochs=epochs, test=test,
                link=link, scope=scope, rate_bps=rate_bps, balance=balance, group=group, repeat=repeat)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")


def settle_assign_schedule(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills adaqp's schedule in ``args`` (``--assign-every`` defaults to the warm-up, at least 1;
    ``--first-assign`` to ``--assign-every``) and refuses values below 1 through ``parser``."""
    if args.assign_every is None:
        args.assign_every = max(1, args.warmup)
    if args.first_assign is None:
        args.first_assign = args.assign_every
    if min(args.assign_every, args.first_assign) < 1:
        parser.error("--assign-every and --first-assign must be >= 1 (epoch 0 gathers the statistics)")


def run_strategy_kwargs(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The strategy keywords a benchmark run adds for ``mode`` (its variant's own settings come
    from ``bench_modes``): the seed; adaptive bits' schedule (first assignment at
    ``args.first_assign``, default ``args.assign_every``) and link costs; Sylvie's staleness."""
    from bench_modes import VARIANT_SETTINGS, base_mode, unbound

    kwargs: dict[str, Any] = {"seed": args.seed}
    if base_mode(mode) == "adaqp" or VARIANT_SETTINGS[unbound(mode)].get("bits") == "adaptive":
        kwargs.update(first_assign=getattr(args, "first_assign", None) or args.assign_every,
                      assign_every=args.assign_every, link_costs=args.link_costs)
    if base_mode(mode) == "sylvie":
        kwargs.update(staleness=args.staleness)
    return kwargs


def run_config(args: argparse.Namespace, cfg: dict[str, Any], run_root: Path, index: int) -> dict[str, Any]:
    section, graph, mode, ranks = cfg["section"], cfg["graph"], cfg["mode"], cfg["ranks"]
    warmup, epochs, repeat = cfg["warmup"], cfg["epochs"], cfg["repeat"]
    tag = (f"{section}-{graph['key']}-{mode}-r{ranks}" + (f"-{_slug(cfg['group'])}" if cfg["group"] else "")
           + (f"-rep{repeat}" if repeat else ""))
    run_dir = run_root / tag
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    from bench_report import COOLDOWN_EPOCHS

    strategy_kwargs = run_strategy_kwargs(args, mode)
    spec = {
        "mode": mode, "ranks": ranks, "epochs": warmup + epochs + COOLDOWN_EPOCHS, "warmup": warmup, "conv": args.conv,
        "hidden": args.hidden, "layers": args.layers, "in_channels": graph["features"],
        "num_classes": graph["classes"], "partition_folder": graph["partitions"][part_key(ranks, cfg["balance"])]["folder"],
        "strategy_kwargs": strategy_kwargs, "test": cfg["test"], "seed": args.seed, "threads": 1,
        "pg_timeout": max(60.0, args.timeout / 2), "run_dir": str(run_dir),
        "result_path": str(run_dir / "result.json"),
    }
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    prefix, link_desc = link_wrapper(cfg["link"], cfg["scope"], ranks, cfg["rate_bps"])
    cmd = prefix + [sys.executable, str(BENCH_DIR / "run.py"), "--worker", str(run_dir / "spec.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port(index, cfg["link"])), GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", BENCH_TC_STATS=str(run_dir / "tc_stats.txt"),
        PYTHONPATH=os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        PYTHONWARNINGS="ignore",
    )
    env.update(MALLOC_ENVS[args.malloc])
    rate = link_rate(cfg["link"], cfg["rate_bps"])
    factor = ranks if cfg["scope"] == "per-rank" else 1
    record: dict[str, Any] = {
        "section": section, "graph_key": graph["key"], "graph_label": graph["label"], "graph_nodes": graph["nodes"],
        "mode": mode, "ranks": ranks, "warmup": warmup, "epochs": epochs, "group": cfg["group"],
        "link": cfg["link"], "link_scope": cfg["scope"], "link_desc": link_desc,
        "balance": cfg["balance"], "run_dir": str(run_dir), "command": shlex.join(cmd),
        "link_base_bps": rate,  # per link
        "link_rate_bps": None if rate is None else rate * factor,  # the bucket's rate
    }
    rc, record["wall_s"] = run_logged(cmd, env, run_dir / "log.txt", args.timeout)
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
    from bench_report import COOLDOWN_EPOCHS, summarize

    result = json.loads(result_path.read_text())
    record["test_acc"] = result.get("test_acc")
    record["fit_wall_s"] = result.get("fit_wall")
    record["logged_last_epoch"] = {k: v for k, v in result.get("logged_last_epoch", {}).items() if k.startswith("comm/")}
    record["summary"] = summarize(result, warmup, COOLDOWN_EPOCHS)
    record["_result"] = result  # merged with repeats, then dropped
    record["ranks_detail"] = [{"rank": r["rank"], "memory": r["memory"], "partition": r["partition"],
                               "strategy": r.get("strategy")} for r in result["ranks"]]
    return record


def _port(index: int, link: str) -> int:
    if link != "none":
        return 29500 + index % 1000  # a private namespace: every port is free
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
