"""The peer column: plain single-process PyG training on the WHOLE graph.

No distribution, no Lightning strategy, no Trainer: the same
:class:`lightning_fullgraph.models.GNNNodeClassifier` architecture the distributed runs train
(same conv, hidden width, layers, dropout, Adam with its learning rate and weight decay,
same initial weights for the same seed, mean cross-entropy on ``train_mask``), trained by a
plain torch loop for ``warmup + epochs`` full-graph steps, each epoch timed.  Two inputs:

* ``edge_index``: the ``[2, E]`` edge list (PyG's gather/scatter message passing),
* ``sparse``: PyG's sparse path, a ``torch.sparse_csr`` adjacency passed as ``adj_t`` in
  place of ``edge_index`` (rows = destinations, columns = sources, i.e. the transpose of the
  adjacency ``edge_index`` lists; PyG's ``ToSparseTensor(layout=torch.sparse_csr)`` builds the
  same matrix): aggregation is one sparse-dense matmul, no ``[E, hidden]`` message tensor.
* ``sparse-cached`` (GCN only): the same, with ``GCNConv(cached=True)``, PyG's option for
  transductive full-graph training: the normalised adjacency is computed at the first step
  and reused, as the distributed adapters reuse their cached CSR blocks.  Without it every
  GCN step re-normalises the adjacency (``gcn_norm``), which the distributed runs do not pay.

Both compute the same logits on a graph without self-loops (GCN's normalisation adds
self-loops with ``add_remaining_self_loops`` on an edge list, but ``add_self_loops`` on a
sparse matrix, so a graph that already has self-loops would be normalised differently;
the run records ``self_loops`` and warns).

``run.py`` starts one fresh process per (input, thread count): ``python benchmarks/run.py
--peer SPEC``, with ``torch.set_num_threads(threads)`` and ``OMP_NUM_THREADS=threads``, so
every peak RSS is that configuration's own.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("sparse", "sparse-cached", "edge_index")


def variants_for(conv: str) -> tuple[str, ...]:
    """``sparse-cached`` differs from ``sparse`` only for GCN (the other convs cache nothing)."""
    return VARIANTS if conv == "gcn" else tuple(v for v in VARIANTS if v != "sparse-cached")


def _memory() -> dict[str, float]:
    from bench_worker import proc_memory

    return proc_memory()


def adjacency_t(edge_index, num_nodes: int):
    """``adj_t``: ``torch.sparse_csr`` ``[N, N]`` with ``adj_t[dst, src] = 1`` for every edge
    ``src -> dst`` (duplicates summed)."""
    import torch
    from torch_geometric.utils import to_torch_csr_tensor

    return to_torch_csr_tensor(edge_index.flip(0).to(torch.long), size=(num_nodes, num_nodes))


def graph_input(edge_index, num_nodes: int, variant: str):
    """What the model's ``forward(x, edge_index)`` gets for a variant."""
    if variant == "edge_index":
        return edge_index
    if variant in ("sparse", "sparse-cached"):
        return adjacency_t(edge_index, num_nodes)
    raise ValueError(f"peer variant {variant!r}; choose from {VARIANTS}")


def build_model(conv: str, in_channels: int, num_classes: int, hidden: int, layers: int, dropout: float = 0.5,
                lr: float = 0.01, seed: int = 0, weight_decay: float = 5e-4):
    """The distributed runs' model, with the same initial weights for the same seed."""
    import lightning.pytorch as pl

    from lightning_fullgraph.models import GNNNodeClassifier

    pl.seed_everything(seed, verbose=False)
    return GNNNodeClassifier(conv=conv, in_channels=in_channels, num_classes=num_classes, hidden_channels=hidden,
                             num_layers=layers, dropout=dropout, lr=lr, weight_decay=weight_decay)


def set_cached(model) -> int:
    """``cached=True`` on every conv that has the option (GCNConv); how many."""
    convs = [c for c in model.convs if hasattr(c, "cached")]
    for c in convs:
        c.cached = True
    return len(convs)


def train_epoch(model, optimizer, x, graph, y, train_mask) -> float:
    """One full-graph training step (forward, masked cross-entropy, backward, Adam); the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    out = model(x, graph)
    loss, _ = model._masked_loss(out, y, train_mask)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def save_graph(data, path: Path) -> None:
    """The tensors the peer needs, in a file ``torch.load(weights_only=True)`` reads."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"x": data.x, "y": data.y, "train_mask": data.train_mask, "edge_index": data.edge_index,
                "num_nodes": int(data.num_nodes)}, tmp)
    tmp.replace(path)


def run_peer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    threads = int(spec["threads"])
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    mem_start = _memory()
    g = torch.load(spec["graph_path"], weights_only=True)
    n = int(g["num_nodes"])
    self_loops = bool((g["edge_index"][0] == g["edge_index"][1]).any())
    t0 = time.perf_counter()
    graph = graph_input(g["edge_index"], n, spec["variant"])
    build_s = time.perf_counter() - t0
    mem_loaded = _memory()
    model = build_model(spec["conv"], int(g["x"].size(1)), int(g["y"].max()) + 1, int(spec["hidden"]),
                        int(spec["layers"]), float(spec.get("dropout", 0.5)), float(spec.get("lr", 0.01)),
                        int(spec.get("seed", 0)))
    if spec["variant"] == "sparse-cached":
        set_cached(model)
    optimizer = model.configure_optimizers()
    epochs: list[dict[str, Any]] = []
    for e in range(int(spec["warmup"]) + int(spec["epochs"])):
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        loss = train_epoch(model, optimizer, g["x"], graph, g["y"], g["train_mask"])
        wall = time.perf_counter() - t
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        epochs.append({"epoch": e, "epoch_time": wall, "loss": loss,
                       "cpu": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
                       "minor_faults": ru1.ru_minflt - ru0.ru_minflt})
    mem_end = _memory()
    peak = max(mem_end.get("VmHWM", 0.0), mem_end.get("ru_maxrss", 0.0))
    baseline = mem_start.get("VmRSS")
    return {
        "spec": spec, "variant": spec["variant"], "threads": torch.get_num_threads(),
        "nodes": n, "edges": int(g["edge_index"].size(1)), "self_loops": self_loops, "build_s": build_s,
        "memory": {"rss_baseline": baseline, "rss_after_load": mem_loaded.get("VmRSS"), "peak_rss": peak,
                   "peak_above_baseline": peak - baseline if baseline is not None else None},
        "epochs": epochs,
    }


def summarize_peer(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    import statistics

    epochs = result["epochs"]
    measured = epochs[min(warmup, max(len(epochs) - 1, 0)):]
    times = [e["epoch_time"] for e in measured]
    return {
        "epochs_measured": len(times),
        "epoch_time": statistics.median(times) if times else None,
        "epoch_time_mean": statistics.fmean(times) if times else None,
        "epoch_time_min": min(times, default=None),
        "epoch_time_max": max(times, default=None),
        "cpu": statistics.median([e["cpu"] for e in measured]) if measured else None,
        "final_loss": epochs[-1]["loss"] if epochs else None,
        "memory": result["memory"],
    }


def main(spec_path: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    result = run_peer(spec)
    from lightning_fullgraph._os import write_atomic

    write_atomic(Path(spec["result_path"]), json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1]))
