"""Time to accuracy: every mode and the single-process peers trained to a target, side by side.

``python benchmarks/run.py --convergence [options]`` (or this file directly) trains, per graph,
every mode (``exact``, ``adaqp``, ``sylvie`` with its defaults, and ``sylvie-pipelined``: the
stale pipeline forced on, ``max_halo_share=1.0, guard=False``) for ``--epochs`` epochs with
validation after every epoch, on ``--ranks`` CPU ranks.  With ``--link 1gbit`` each mode's run
happens in its own network namespace whose loopback is throttled (``unshare -n`` + ``tc tbf``,
as in ``run.py``), so every epoch's training time is measured on that link, in the same run that
produces the accuracy curve.

Reported per graph and mode:

* the halo share of the aggregation inputs (edges from halo rows over all edges plus one self
  term per node), from the partitions;
* best and final validation metric (accuracy, or ROC-AUC for tolokers);
* the target, ``exact's best - 0.5 points`` (``--target-gap``), and each mode's epochs to
  target and training seconds to target: the sum of the epochs' training-step times (max over
  ranks) up to the first epoch at or above the target; validation time is not counted;
* the peers, in one process with ``--peer-threads`` threads: PyG full-graph on the whole
  graph (the sparse CSR path), and mini-batch PyG (``NeighborLoader``, fan-outs ``[15, 10, 5]``)
  when ``pyg-lib`` or ``torch-sparse`` is importable (else the report says it was not run and
  why).

``--conv sage`` trains GraphSAGE instead of GCN (every run and peer).

Writes ``<out>/<name>.json``, ``.md`` and ``.png`` (validation metric against training
seconds, every mode and peer).  Example::

    python benchmarks/run.py --convergence --graphs lowloc,cora,citeseer,tolokers --link 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from common import SHARED, check_link_support, link_wrapper, lowloc_graph, parse_rate  # noqa: E402

GRAPHS = ("lowloc", "cora", "citeseer", "tolokers", "products-like")
MODES: dict[str, dict[str, Any]] = {
    "exact": {"mode": "exact"},
    "adaqp": {"mode": "adaqp"},
    "sylvie": {"mode": "sylvie"},
    "sylvie-pipelined": {"mode": "sylvie", "max_halo_share": 1.0, "guard": False},
    # the seed's Bounded Staleness Adaptor (rate per second) whatever the halo share
    "sylvie-adaptive": {"mode": "sylvie", "epoch_adaptive": True},
    # the defaults before epoch_adaptive="auto": fixed bits (synchronous 1-bit above max_halo_share)
    "sylvie-fixed": {"mode": "sylvie", "epoch_adaptive": False},
    # two bits instead of one (a candidate default above max_halo_share)
    "sylvie-2bit": {"mode": "sylvie", "bits": 2},
    # every layer sends its input (project_messages=False), as before 2026-12-07
    "exact-inputs": {"mode": "exact", "project_messages": False},
    "adaqp-inputs": {"mode": "adaqp", "project_messages": False},
    "sylvie-inputs": {"mode": "sylvie", "project_messages": False},
}
FANOUTS = [15, 10, 5]
#: ``--conv`` choices and how the report names them
CONV_NAMES = {"gcn": "GCN", "sage": "GraphSAGE"}
#: settings two results files must share for their runs to sit in one table
MERGE_KEYS = ("ranks", "link", "epochs", "conv", "hidden", "layers", "weight_decay", "target_gap")
#: what a setting was in files written before its option existed
_SETTING_DEFAULTS = {"weight_decay": 5e-4, "conv": "gcn"}


def setting(result: dict[str, Any], key: str) -> Any:
    """A results file's setting, or what it was before the file format recorded it."""
    return result.get(key, _SETTING_DEFAULTS.get(key))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="lowloc,cora,citeseer",
                   help=f"comma-separated, from {GRAPHS} (products-like takes --nodes)")
    p.add_argument("--modes", default="exact,adaqp,sylvie,sylvie-pipelined", help=f"comma-separated, from {tuple(MODES)}")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=100, help="training budget of every run")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (means are reported)")
    p.add_argument("--link", choices=("none", "1gbit", "10gbit", "calibrated"), default="none",
                   help="emulated link, one bucket for all ranks; calibrated: the rate of --link-rate (e.g. the "
                   "communication-bound preset's, from `run.py --commbound`'s calibration table)")
    p.add_argument("--link-rate", help="--link calibrated: bit/s of the shared link, e.g. 666mbit")
    p.add_argument("--target-gap", type=float, default=0.005, help="target = exact's best - this")
    p.add_argument("--nodes", type=int, default=1_000_000, help="products-like nodes")
    p.add_argument("--conv", choices=tuple(CONV_NAMES), default="gcn",
                   help="the model's conv layers, every run and peer (GNNNodeClassifier's conv)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--weight-decay", type=float, default=5e-4,
                   help="Adam's weight decay, every run and peer (default: GNNNodeClassifier's, 5e-4)")
    p.add_argument("--peer-threads", type=int, default=2)
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--no-minibatch", action="store_true", help="run the full-graph peer only")
    p.add_argument("--minibatch-val-every", type=int, default=0, metavar="STEPS",
                   help="also validate the mini-batch peer every STEPS steps inside an epoch (its time to target "
                   "is otherwise known to one epoch; validation is not counted as training time)")
    p.add_argument("--peer-stop-at-target", action="store_true",
                   help="end each peer's run after the first epoch at or above the target (exact's runs must be "
                   "there); its best and final are then those of the epochs it ran, and the report says so")
    p.add_argument("--name", default="convergence")
    p.add_argument("--out-dir", default=str(BENCH_DIR / "results"))
    p.add_argument("--cache-dir", default=str(BENCH_DIR / ".cache"))
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--render", help="redraw the .md/.png of a results .json")
    p.add_argument("--add-peers", help="run the peers for the graphs of a results .json (e.g. from an environment "
                   "with torch-sparse for the mini-batch peer) and rewrite it with them")
    p.add_argument("--merge", metavar="A.json,B.json,...",
                   help="combine results files of the same settings (ranks, link, budget, model, gap; each graph's "
                   "partition) into <out-dir>/<name>: each (graph, run, seed) taken from the one file that has it; "
                   "the target and means are recomputed over all of them")
    return p.parse_args(argv)


# -- graphs ------------------------------------------------------------------------------
def load_graph(name: str, nodes: int, cache_dir: Path):
    """(data, metric): ``metric`` is ``"accuracy"`` or ``"rocauc"``."""
    from lightning_fullgraph.data.datasets import load_dataset

    if name == "lowloc":
        return lowloc_graph(), "accuracy"
    if name in ("cora", "citeseer"):
        return load_dataset(name, root=SHARED / "Planetoid", cache_dir=cache_dir), "accuracy"
    if name == "tolokers":
        return load_dataset("tolokers", root=SHARED / "Heterophilous", cache_dir=cache_dir), "rocauc"
    if name == "products-like":
        from lightning_fullgraph.data.datasets import products_like_graph

        return products_like_graph(num_nodes=nodes, seed=0), "accuracy"
    raise ValueError(f"graph {name!r}; choose from {GRAPHS}")


def halo_share(folder: Path, parts: int) -> float:
    from lightning_fullgraph.partition.cache import load_part

    halo = total = 0
    for r in range(parts):
        part = load_part(folder, r)
        src = part.data.edge_index[0]
        halo += int((src >= part.plan.num_owned).sum())
        total += src.numel() + part.plan.num_owned
    return halo / max(total, 1)


# -- one distributed run (a worker process) ----------------------------------------------
def _callback(out_dir: Path, metric_key: str):
    import lightning.pytorch as pl

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.epochs: list[dict[str, Any]] = []
            self._t0 = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            st = trainer.strategy
            ex = getattr(st, "exchanger", None)
            self.epochs.append({
                "epoch": trainer.current_epoch, "train_s": time.perf_counter() - self._t0,
                "bytes_sent": int(sum(ex.stats.bytes_sent.values())) if ex is not None else 0,
                "sync": bool(getattr(st.policy, "synchronous", True)),
            })

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            value = trainer.callback_metrics.get(metric_key)
            loss = trainer.callback_metrics.get("train_loss")
            if self.epochs:
                self.epochs[-1]["val"] = None if value is None else float(value)
                self.epochs[-1]["train_loss"] = None if loss is None else float(loss)

        def on_train_end(self, trainer, pl_module) -> None:
            path = out_dir / f"rank{trainer.global_rank}.json"
            path.write_text(json.dumps({"rank": trainer.global_rank, "epochs": self.epochs,
                                        "halo_share": getattr(trainer.strategy, "halo_share", None)}))

    return Record()


def run_worker(spec: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
    from lightning_fullgraph.models import GNNNodeClassifier

    torch.set_num_threads(1)
    data, metric = load_graph(spec["graph"], spec["nodes"], Path(spec["cache_dir"]))
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(spec["seed"], verbose=False)
    num_classes = int(data.y.max()) + 1
    model = GNNNodeClassifier(conv=spec.get("conv", "gcn"), in_channels=data.num_features, num_classes=num_classes,
                              hidden_channels=spec["hidden"], num_layers=spec["layers"], dropout=0.5, lr=0.01,
                              weight_decay=spec.get("weight_decay", 5e-4),
                              metric=metric)
    dm = FullGraphDataModule(data, num_parts=spec["ranks"], cache_dir=spec["cache_dir"] + "/convergence-parts")
    kwargs = dict(MODES[spec["mode"]])
    if kwargs["mode"] == "adaqp":
        kwargs["link_costs"] = "uniform" if spec["link"] == "none" else "measure"
    trainer = pl.Trainer(
        accelerator="cpu", devices=spec["ranks"],
        strategy=FullGraphStrategy(start_method="fork", timeout=timedelta(seconds=300), seed=spec["seed"], **kwargs),
        max_epochs=spec["epochs"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[_callback(out_dir, "val_rocauc" if metric == "rocauc" else "val_acc")],
    )
    trainer.fit(model, datamodule=dm)


def merge_ranks(out_dir: Path, ranks: int) -> dict[str, Any]:
    """Per epoch: the slowest rank's training time, rank 0's validation metric."""
    recs = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(ranks)]
    epochs = []
    for i, e0 in enumerate(recs[0]["epochs"]):
        epochs.append({"epoch": e0["epoch"], "train_s": max(r["epochs"][i]["train_s"] for r in recs),
                       "bytes_sent": sum(r["epochs"][i]["bytes_sent"] for r in recs), "sync": e0["sync"],
                       "val": e0.get("val"), "train_loss": e0.get("train_loss")})
    return {"epochs": epochs, "halo_share": recs[0].get("halo_share")}


# -- the peers (one process) -------------------------------------------------------------
def run_full_peer(data, metric: str, epochs: int, threads: int, seed: int, hidden: int, layers: int,
                  weight_decay: float = 5e-4, stop_at: float | None = None, conv: str = "gcn") -> dict[str, Any]:
    """Single-process PyG, full graph (the sparse CSR path): one step per epoch, then validation.
    With ``stop_at``, the run ends after the first epoch whose validation reaches it."""
    import torch
    from peer import adjacency_t, build_model, train_epoch

    torch.set_num_threads(threads)
    graph = adjacency_t(data.edge_index, data.num_nodes)
    model = build_model(conv, data.num_features, int(data.y.max()) + 1, hidden, layers, seed=seed,
                        weight_decay=weight_decay)
    model.hparams.metric = metric
    optimizer = model.configure_optimizers()
    rows = []
    for e in range(epochs):
        t = time.perf_counter()
        train_epoch(model, optimizer, data.x, graph, data.y, data.train_mask)
        wall = time.perf_counter() - t
        rows.append({"epoch": e, "train_s": wall, "val": _evaluate(model, data, graph, metric)})
        if _reached(rows, stop_at):
            return {"epochs": rows, "stopped_at_target": True}
    return {"epochs": rows}


def _reached(rows: list[dict[str, Any]], stop_at: float | None) -> bool:
    return stop_at is not None and rows[-1]["val"] >= stop_at


def _evaluate(model, data, graph, metric: str) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        out = model(data.x, graph)
    mask = data.val_mask
    if metric == "rocauc":
        from torchmetrics.functional.classification import binary_auroc

        return float(binary_auroc(out[mask].softmax(-1)[:, 1], data.y[mask]))
    return float((out[mask].argmax(-1) == data.y[mask]).float().mean())


def minibatch_unavailable() -> str | None:
    try:
        import torch_geometric.typing as t
    except ImportError as exc:  # pragma: no cover
        return str(exc)
    if getattr(t, "WITH_PYG_LIB", False) or getattr(t, "WITH_TORCH_SPARSE", False):
        return None
    return ("NeighborLoader needs pyg-lib or torch-sparse, neither importable here: pyg-lib has no wheel on PyPI; "
            "build torch-scatter and torch-sparse from source in a benchmark environment and run --add-peers "
            "there (benchmarks/README.md)")


def run_minibatch_peer(data, metric: str, epochs: int, threads: int, seed: int, hidden: int, layers: int,
                       weight_decay: float = 5e-4, stop_at: float | None = None, val_every: int = 0,
                       batch_size: int = 1024, conv: str = "gcn") -> dict[str, Any]:
    """Single-process mini-batch PyG (``NeighborLoader``, fan-outs ``FANOUTS``, ``batch_size``
    training nodes a step), validated on the full graph after each epoch and, with
    ``val_every``, after every ``val_every`` steps as well. Each validation ends a row whose
    ``train_s`` is the training time since the previous one and whose ``epochs_done`` is the
    fraction of epochs trained so far. ``stop_at`` as for :func:`run_full_peer`."""
    import torch
    from peer import adjacency_t, build_model
    from torch_geometric.loader import NeighborLoader

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = build_model(conv, data.num_features, int(data.y.max()) + 1, hidden, layers, seed=seed,
                        weight_decay=weight_decay)
    optimizer = model.configure_optimizers()
    loader = NeighborLoader(data, num_neighbors=FANOUTS[:layers] + [FANOUTS[-1]] * max(0, layers - len(FANOUTS)),
                            input_nodes=data.train_mask, batch_size=batch_size, shuffle=True)
    full = adjacency_t(data.edge_index, data.num_nodes)
    rows = []
    steps = len(loader)
    for e in range(epochs):
        t = time.perf_counter()
        model.train()
        for step, batch in enumerate(loader, 1):
            optimizer.zero_grad(set_to_none=True)
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            torch.nn.functional.cross_entropy(out, batch.y[: batch.batch_size]).backward()
            optimizer.step()
            if step == steps or (val_every and step % val_every == 0):
                wall = time.perf_counter() - t
                rows.append({"epoch": e, "epochs_done": e + step / steps, "train_s": wall,
                             "val": _evaluate(model, data, full, metric)})
                print(f"[peer-minibatch seed {seed}] epoch {e} step {step}/{steps}: {wall:.1f} s, "
                      f"val {rows[-1]['val']:.4f}", flush=True)
                if _reached(rows, stop_at):
                    return {"epochs": rows, "stopped_at_target": True}
                model.train()
                t = time.perf_counter()
    return {"epochs": rows}


# -- the comparison ----------------------------------------------------------------------
def to_target(epochs: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """(epochs to the first validation value >= target, training seconds up to it), or
    ``(None, None)`` when the budget ran out first. A row validated inside an epoch (the
    mini-batch peer's ``--minibatch-val-every``) counts the fraction it had trained."""
    seconds = 0.0
    for i, e in enumerate(epochs):
        seconds += e["train_s"]
        if e.get("val") is not None and e["val"] >= target:
            return e.get("epochs_done", i + 1), seconds
    return None, None


def _epochs_trained(r: dict[str, Any]) -> float:
    return r["epochs"][-1].get("epochs_done", len(r["epochs"]))


def summarize(runs: dict[str, list[dict[str, Any]]], gap: float) -> dict[str, Any]:
    """Per mode, means over seeds: best, final (mean of the last 5 epochs); epochs and seconds
    to target as means over the seeds that reached it (``reached`` counts them).  The target
    is the mean over seeds of exact's best minus ``gap``."""

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    exact_best = mean(max(e["val"] for e in r["epochs"] if e["val"] is not None) for r in runs.get("exact", []))
    target = None if exact_best is None else exact_best - gap
    table = {}
    for mode, seeds in runs.items():
        vals = [[e["val"] for e in r["epochs"] if e["val"] is not None] for r in seeds]
        hits = [to_target(r["epochs"], target) if target is not None else (None, None) for r in seeds]
        table[mode] = {
            "best": mean(max(v) for v in vals), "final": mean(sum(v[-5:]) / len(v[-5:]) for v in vals),
            # over the seeds that reached the target (how many did is reported beside it)
            "epochs_to_target": mean(h[0] for h in hits),
            "seconds_to_target": mean(h[1] for h in hits),
            "reached": sum(h[0] is not None for h in hits), "seeds": len(seeds),
            "epoch_s": mean(sum(e["train_s"] for e in r["epochs"]) / _epochs_trained(r) for r in seeds),
            "mb_per_epoch": mean(sum(e.get("bytes_sent", 0) for e in r["epochs"]) / _epochs_trained(r) / 1e6
                                 for r in seeds),
        }
    ex = table.get("exact", {})
    for row in table.values():
        s, e = row["seconds_to_target"], ex.get("seconds_to_target")
        row["speedup_vs_exact"] = e / s if s and e else None
        n, m = row["epochs_to_target"], ex.get("epochs_to_target")
        row["epochs_vs_exact"] = n / m if n and m else None
    return {"exact_best": exact_best, "target": target, "modes": table}


def render(result: dict[str, Any], out: Path) -> None:
    decay = f", weight decay {setting(result, 'weight_decay'):g}"
    lines = [f"# Time to accuracy ({result['created']})", "",
             f"`{result['command']}`", "",
             f"{result['ranks']} ranks, link {result['link']}, {CONV_NAMES[setting(result, 'conv')]} {result['layers']} x {result['hidden']}, Adam 0.01{decay}, "
             f"dropout 0.5, budget {result['epochs']} epochs, seeds {result['seeds']}; target = exact's best - "
             f"{100 * result['target_gap']:.1f} pt (mean over seeds); epochs and seconds to target are means over "
             "the seeds that reached it (how many in brackets); seconds = training steps only (slowest rank), "
             "not validation; the peers run in one process.", ""]
    if result.get("merged_from"):
        # seconds are only comparable within one run of this shared host
        lines += [f"Merged from {', '.join(result['merged_from'])} (`--merge`): runs from different files ran at "
                  "different times on a shared host, so their seconds compare only roughly; epochs and accuracy "
                  "do not depend on it.", ""]
    for g in result["graphs"]:
        s = g["summary"]
        lines += [f"## {g['graph']} ({g['metric']}; halo share of aggregation inputs {100 * g['halo_share']:.1f} %)", "",
                  f"target {s['target']:.4f}" if s["target"] is not None else "no exact run: no target", "",
                  "| run | best | final (last 5) | epochs to target | x exact | s to target | speed-up vs exact | "
                  "s / epoch | MB sent / epoch |", "|---|---|---|---|---|---|---|---|---|"]

        def f(x, fmt):
            return "—" if x is None else format(x, fmt)

        for mode, r in s["modes"].items():
            lines.append(f"| {mode} | {f(r['best'], '.4f')} | {f(r['final'], '.4f')} | "
                         f"{f(r['epochs_to_target'], '.1f')} ({r['reached']}/{r['seeds']}) | {f(r['epochs_vs_exact'], '.2f')} | "
                         f"{f(r['seconds_to_target'], '.2f')} | {f(r['speedup_vs_exact'], '.2f')} | {f(r['epoch_s'], '.3f')} | "
                         f"{f(r['mb_per_epoch'], '.2f')} |")
        stopped = [mode for mode, seeds in g["runs"].items() if any(r.get("stopped_at_target") for r in seeds)]
        if stopped:
            lines += ["", f"stopped at the target (`--peer-stop-at-target`): {', '.join(stopped)}; their best and "
                      "final are those of the epochs they ran"]
        if g.get("minibatch_skipped"):
            lines += ["", f"mini-batch peer not run: {g['minibatch_skipped']}"]
        if g.get("peers_from"):
            # the peers run no package code: a run may reuse those of an earlier one
            lines += ["", f"peers' runs taken from {g['peers_from']}"]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    graphs = result["graphs"]
    fig, axes = plt.subplots(1, len(graphs), figsize=(5 * len(graphs), 4), squeeze=False)
    for ax, g in zip(axes[0], graphs):
        for mode, seeds in g["runs"].items():
            r = seeds[0]
            xs, t = [], 0.0
            for e in r["epochs"]:
                t += e["train_s"]
                xs.append(t)
            ax.plot(xs, [e["val"] for e in r["epochs"]], label=mode, lw=1.2)
        if g["summary"]["target"] is not None:
            ax.axhline(g["summary"]["target"], color="grey", ls=":", lw=1)
        ax.set_title(f"{g['graph']} (halo {100 * g['halo_share']:.0f} %)")
        ax.set_xlabel("training seconds (seed 0)")
        ax.set_ylabel(f"val {g['metric']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def peers(entry: dict[str, Any], data, metric: str, args: argparse.Namespace, seeds: list[int]) -> None:
    """Adds the peers' runs to a graph's entry (the mini-batch one where it can run; a
    full-graph peer already there is kept)."""
    runs = entry["runs"]
    stop_at = None
    if args.peer_stop_at_target:
        stop_at = summarize({"exact": runs.get("exact", [])}, args.target_gap)["target"]
        if stop_at is None:
            raise SystemExit("--peer-stop-at-target needs exact's runs (the target is exact's best - the gap)")
    if "peer-fullgraph" not in runs:
        runs["peer-fullgraph"] = [run_full_peer(data, metric, args.epochs, args.peer_threads, s, args.hidden,
                                                args.layers, args.weight_decay, stop_at=stop_at, conv=args.conv)
                                  for s in seeds]
    why = "--no-minibatch was given" if args.no_minibatch else minibatch_unavailable()
    if why is None:
        runs["peer-minibatch"] = [run_minibatch_peer(data, metric, args.epochs, args.peer_threads, s, args.hidden,
                                                     args.layers, args.weight_decay, stop_at=stop_at,
                                                     val_every=args.minibatch_val_every, conv=args.conv)
                                     for s in seeds]
        entry.pop("minibatch_skipped", None)
    else:
        entry["minibatch_skipped"] = why


def add_peers(args: argparse.Namespace, path: Path) -> int:
    """Runs the peers for every graph of a results file, with its budget and seeds."""
    result = json.loads(path.read_text())
    args.epochs, args.hidden, args.layers = result["epochs"], result["hidden"], result["layers"]
    args.weight_decay, args.conv = setting(result, "weight_decay"), setting(result, "conv")
    args.target_gap = result["target_gap"]
    argv = [a for a in sys.argv[1:] if a != "--convergence"]
    result["command"] += f" ; peers: python benchmarks/run.py --convergence {shlex.join(argv)}"
    for entry in result["graphs"]:
        data, metric = load_graph(entry["graph"], args.nodes, Path(args.cache_dir))
        peers(entry, data, metric, args, result["seeds"])
        entry["summary"] = summarize(entry["runs"], result["target_gap"])
        print(f"[{entry['graph']}] peers added", flush=True)
    path.write_text(json.dumps(result, indent=1))
    render(result, path)
    print(path.with_suffix(".md").read_text())
    return 0


def _seeded(runs: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """The runs with their seeds (files written before runs carried one list them in ``seeds`` order)."""
    return [dict(r, seed=r.get("seed", s)) for r, s in zip(runs, seeds, strict=True)]


def merge_results(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One result from several with the same settings (:data:`MERGE_KEYS`): per graph, the union
    of the runs, each (run, seed) from the one file that has it, sorted by seed; the summary is
    recomputed (so the target is exact's mean best over every exact seed there is).

    Raises:
        SystemExit: the files differ in a setting, a graph's halo share (another partition), or
            hold the same (graph, run, seed) twice.
    """
    first = results[0]
    for name, r in zip(names[1:], results[1:]):
        for key in MERGE_KEYS:
            if setting(r, key) != setting(first, key):
                raise SystemExit(f"--merge: {name} has {key}={setting(r, key)!r}, {names[0]} "
                                 f"{setting(first, key)!r}; only runs of the same settings share a table")
    graphs: dict[str, dict[str, Any]] = {}
    for name, r in zip(names, results):
        for g in r["graphs"]:
            entry = graphs.setdefault(g["graph"], {"graph": g["graph"], "metric": g["metric"],
                                                   "halo_share": g["halo_share"], "runs": {}, "from": name})
            if abs(entry["halo_share"] - g["halo_share"]) > 1e-9:
                raise SystemExit(f"--merge: {g['graph']} has halo share {g['halo_share']:.6f} in {name} and "
                                 f"{entry['halo_share']:.6f} in {entry['from']}: not the same partition")
            for key in ("minibatch_skipped", "peers_from"):
                if key in g:
                    entry[key] = g[key]
            for mode, runs in g["runs"].items():
                have = entry["runs"].setdefault(mode, [])
                for run in _seeded(runs, r["seeds"]):
                    if any(h["seed"] == run["seed"] for h in have):
                        raise SystemExit(f"--merge: {g['graph']}/{mode}/seed {run['seed']} is in more than one file")
                    have.append(run)
    for entry in graphs.values():
        del entry["from"]
        for runs in entry["runs"].values():
            runs.sort(key=lambda run: run["seed"])
        entry["summary"] = summarize(entry["runs"], first["target_gap"])
    seeds = sorted({run["seed"] for e in graphs.values() for runs in e["runs"].values() for run in runs})
    return {**{k: setting(first, k) for k in MERGE_KEYS}, "seeds": seeds,
            "created": ", ".join(r["created"] for r in results),
            "command": " ; ".join(r["command"] for r in results), "merged_from": names,
            "graphs": list(graphs.values())}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(json.loads(Path(args.worker).read_text()))
        return 0
    out = Path(args.out_dir) / args.name
    if args.render:
        render(json.loads(Path(args.render).read_text()), Path(args.render))
        return 0
    if args.add_peers:
        return add_peers(args, Path(args.add_peers))
    if args.merge:
        paths = [Path(x) for x in args.merge.split(",") if x]
        merged = merge_results([json.loads(x.read_text()) for x in paths], [x.name for x in paths])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(merged, indent=1))
        render(merged, out)
        print(out.with_suffix(".md").read_text())
        return 0
    from lightning_fullgraph import FullGraphDataModule

    if (args.link == "calibrated") != (args.link_rate is not None):
        raise SystemExit("--link calibrated and --link-rate go together")
    rate_bps = parse_rate(args.link_rate) if args.link_rate else None
    if args.link != "none":
        why = check_link_support()
        if why is not None:
            raise SystemExit(f"--link {args.link}: {why}; run with --link none")
    cache = Path(args.cache_dir)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    result: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python benchmarks/run.py --convergence",
                                                                           *(argv if argv is not None else sys.argv[1:])]),
        "ranks": args.ranks, "link": args.link if rate_bps is None else f"{rate_bps / 1e6:g} Mbit/s (calibrated)",
        "epochs": args.epochs, "seeds": seeds, "conv": args.conv, "hidden": args.hidden,
        "layers": args.layers, "weight_decay": args.weight_decay, "target_gap": args.target_gap, "graphs": [],
    }
    for graph in [g for g in args.graphs.split(",") if g]:
        data, metric = load_graph(graph, args.nodes, cache)
        dm = FullGraphDataModule(data, num_parts=args.ranks, cache_dir=str(cache) + "/convergence-parts")
        dm.prepare_data()
        assert dm.partition_result is not None
        share = halo_share(dm.partition_result.folder, args.ranks)
        print(f"[{graph}] halo share {share:.3f}", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {}
        entry: dict[str, Any] = {"graph": graph, "metric": metric, "halo_share": share, "runs": runs}
        result["graphs"].append(entry)
        for mode in modes:
            for seed in seeds:
                work = Path(tempfile.mkdtemp(prefix=f"conv-{graph}-{mode}-"))
                spec = {"graph": graph, "nodes": args.nodes, "mode": mode, "seed": seed, "ranks": args.ranks,
                        "epochs": args.epochs, "conv": args.conv, "hidden": args.hidden, "layers": args.layers,
                        "weight_decay": args.weight_decay, "link": args.link,
                        "cache_dir": str(cache), "out_dir": str(work)}
                (work / "spec.json").write_text(json.dumps(spec))
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(work / "spec.json")]
                wrap, _ = link_wrapper(args.link, "shared", args.ranks, rate_bps)
                t0 = time.perf_counter()
                env = dict(os.environ, BENCH_TC_STATS=str(work / "tc.txt"),
                           MASTER_PORT=str(29600 + (os.getpid() + len(runs)) % 2000))
                cmd = wrap + cmd
                proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"{graph}/{mode}/seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                rec = merge_ranks(work, args.ranks)
                rec["wall_s"], rec["seed"] = time.perf_counter() - t0, seed
                runs.setdefault(mode, []).append(rec)
                vals = [e["val"] for e in rec["epochs"] if e["val"] is not None]
                print(f"[{graph}] {mode} seed {seed}: best {max(vals):.4f} final {vals[-1]:.4f} "
                      f"({rec['wall_s']:.0f} s)", flush=True)
                # after every run, so an interrupted study keeps what it measured (--merge joins studies)
                _save(result, entry, out)
        if not args.no_peers:
            peers(entry, data, metric, args, seeds)
        _save(result, entry, out)
    print(out.with_suffix(".md").read_text())
    return 0


def _save(result: dict[str, Any], entry: dict[str, Any], out: Path) -> None:
    entry["summary"] = summarize(entry["runs"], result["target_gap"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    render(result, out)


if __name__ == "__main__":
    sys.exit(main())
