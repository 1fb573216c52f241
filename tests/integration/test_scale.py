"""The products-like graph end to end: by name in ``FullGraphDataModule`` and the
``partition`` command (which reports its time and memory), the cache reused without
generating the graph again, and no rank > 0 ever building the global graph.

The sizes are tiny; ``python benchmarks/run.py --scale`` measures the real thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_fullgraph.data.datasets.products_like as generated
from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.cli.partition import partition_main
from lightning_fullgraph.models import GNNNodeClassifier
from tests.helpers import cpu_trainer

REPO = Path(__file__).resolve().parents[2]
KWARGS = {"num_nodes": 3000}


def _count_generation(monkeypatch, log: Path) -> None:
    """Every call of the generator appends the calling rank to ``log`` (forked ranks inherit
    the patch): the process-group rank, or -1 outside a process group."""
    original = generated.products_like_graph

    def counting(*args, **kwargs):
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        return original(*args, **kwargs)

    monkeypatch.setattr(generated, "products_like_graph", counting)


def _calls(log: Path) -> list[int]:
    """The ranks that called the generator, in call order."""
    return [int(line) for line in log.read_text().split()] if log.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_partition_command_reports_time_and_memory_and_reuses_the_cache(tmp_path, capsys) -> None:
    """``partition --data products-like --dataset-kwargs ... --json`` reports per-phase wall
    time and the peak RSS, and they are plausible: the peak exceeds both the import baseline
    and the graph's own size, generation and METIS took time.  A second run reuses the cache
    (``cache_hit``, no METIS time, "cache reused" in the text output).  Negative control: a
    different ``num_nodes`` is a cache miss."""
    cache = tmp_path / "cache"
    args = ["--data", "products-like", "--dataset-kwargs", json.dumps(KWARGS), "--num-parts", "2"]
    args += ["--cache-dir", str(cache)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, "-m", "lightning_fullgraph", "partition", *args, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    first = json.loads(out[out.index("{") :])
    assert first["cache_hit"] is False and first["num_nodes"] == 3000
    assert first["num_features"] == 100 and first["num_classes"] == 47
    phases = first["phase_seconds"]
    assert set(phases) >= {"load", "check", "metis", "plan", "write", "statistics"}
    assert phases["load"] > 0 and phases["metis"] > 0 and phases["plan"] > 0 and phases["write"] > 0
    assert first["partition_seconds"] >= phases["metis"] + phases["plan"]
    e, n = first["num_edges"], first["num_nodes"]
    assert first["graph_mib"] == pytest.approx((16 * e + 400 * n + 11 * n) / 2**20)
    assert first["peak_rss_mib"] > first["baseline_rss_mib"] > 50
    assert first["peak_rss_mib"] > first["graph_mib"]
    assert first["phase_peak_rss_mib"]["metis"] >= first["phase_peak_rss_mib"]["load"]
    # the reported peak is the larger of this process's and the bound with forked orderings
    assert first["peak_rss_mib"] == max(first["process_peak_rss_mib"], first["forked_peak_mib"])

    assert partition_main([*args, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["cache_hit"] is True and again["folder"] == first["folder"]
    assert again["phase_seconds"]["metis"] == 0 and again["phase_seconds"]["load"] == 0
    assert partition_main(args) == 0
    text = capsys.readouterr().out
    assert (
        "cache reused" in text
        and "peak memory" in text
        and "metis" not in text.split("time:")[1].split(";")[0]
    )

    other = ["--dataset-kwargs", json.dumps({"num_nodes": 2500})]
    assert partition_main([*args, *other, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache_hit"] is False


def test_datamodule_generates_once_and_not_on_a_cache_hit(tmp_path, monkeypatch) -> None:
    """``FullGraphDataModule("products-like", dataset_kwargs=...)`` partitions the generated
    graph, then drops it (nothing of the global graph is kept through training); a second
    datamodule finds the cache from the name and arguments alone and never generates.
    Negative control: other arguments generate again."""
    log = tmp_path / "calls"
    _count_generation(monkeypatch, log)
    dm = FullGraphDataModule("products-like", num_parts=2, dataset_kwargs=KWARGS, cache_dir=tmp_path / "c")
    dm.prepare_data()
    assert dm.partition_result.rebuilt and len(_calls(log)) == 1
    assert dm._graph is None
    dm2 = FullGraphDataModule("products_like", num_parts=2, dataset_kwargs=KWARGS, cache_dir=tmp_path / "c")
    dm2.prepare_data()
    assert not dm2.partition_result.rebuilt and dm2.partition_result.folder == dm.partition_result.folder
    assert len(_calls(log)) == 1
    dm3 = FullGraphDataModule(
        "products-like", num_parts=2, dataset_kwargs={"num_nodes": 2900}, cache_dir=tmp_path / "c"
    )
    dm3.prepare_data()
    assert dm3.partition_result.rebuilt and len(_calls(log)) == 2


def _fit(data, tmp_path: Path, **kwargs) -> None:
    torch.manual_seed(0)
    model = GNNNodeClassifier(conv="gcn", in_channels=100, num_classes=47, hidden_channels=16, num_layers=2)
    dm = FullGraphDataModule(data, cache_dir=tmp_path / "c", **kwargs)
    cpu_trainer(2, max_epochs=1).fit(model, datamodule=dm)


@pytest.mark.timeout(180)
def test_ranks_above_zero_never_build_the_global_graph(tmp_path, monkeypatch) -> None:
    """A 2-rank fit (forked ranks inherit the counting generator): with a cold cache the
    graph is generated exactly once, by rank 0 (or the launcher, before any rank starts),
    never by rank 1;
    with the cache warm, or with the partition folder given as ``data``, it is never
    generated at all.  Negative control: the counter does see the cold-cache generation."""
    log = tmp_path / "calls"
    _count_generation(monkeypatch, log)
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    _fit("products-like", tmp_path, dataset_kwargs=KWARGS)
    first = _calls(log)
    assert len(first) == 1 and first[0] in (0, -1), first
    _fit("products-like", tmp_path, dataset_kwargs=KWARGS)
    assert _calls(log) == first
    (folder,) = [p for p in (tmp_path / "c").iterdir() if (p / "manifest.json").is_file()]
    _fit(str(folder), tmp_path)
    assert _calls(log) == first
