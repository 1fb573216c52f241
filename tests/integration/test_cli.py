"""The ``lightning-fullgraph`` command line, used as a user would.

* Two subprocess runs of ``python -m lightning_fullgraph fit`` on 2 CPU ranks with the
  default ``popen`` launcher (the strategy given by registry name, then by class_path),
  checked through the TensorBoard event files they write.
* ``partition`` twice (the second is a cache hit), then ``fit`` on the printed folder.
* Every example config parses and instantiates; ``--help`` lists every subcommand.

In-process calls of :func:`lightning_fullgraph.cli.main` use one device: the ``popen``
launcher starts ranks 1..N-1 by re-running ``sys.argv``, which under pytest is pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml

from lightning_fullgraph import FullGraphStrategy
from lightning_fullgraph.cli import main
from lightning_fullgraph.cli.train import FullGraphCLI
from lightning_fullgraph.models import GNNNodeClassifier
from tests.conftest import REPO, free_port
from tests.processes import run_process

CONFIGS = REPO / "examples" / "configs"
ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))

# A small generated graph and few epochs: each 2-rank subprocess run takes ~15 s here.
SMALL_GRAPH = json.dumps({"num_nodes": 1000, "num_val": 300, "num_test": 300})
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    """In-process runs write lightning_logs/ and config.yaml into the working directory."""
    monkeypatch.chdir(tmp_path)


def _user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.pop("PL_GLOBAL_SEED", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(free_port())
    env["LIGHTNING_FULLGRAPH_CACHE"] = str(tmp_path / "partitions")
    return env


def _run_cli(args: list[str], tmp_path: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    proc = run_process(
        [sys.executable, "-m", "lightning_fullgraph", *args],
        cwd=tmp_path,
        env=_user_env(tmp_path),
        merge_stderr=False,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"`lightning_fullgraph {' '.join(args)}` exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def _scalars(log_root: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = sorted(log_root.rglob("events.out.tfevents.*"))
    assert event_files, f"no TensorBoard event file under {log_root}"
    scalars: dict[str, list[float]] = {}
    for folder in sorted({f.parent for f in event_files}):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return scalars


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", ["community_gcn.yaml", "strategy_class_path.yaml"])
def test_fit_two_ranks_subprocess(config, tmp_path):
    """`python -m lightning_fullgraph fit --config X` on 2 CPU ranks (popen launcher)."""
    epochs = 4
    runs = tmp_path / "runs"
    proc = _run_cli(
        [
            "fit",
            "--config",
            str(CONFIGS / config),
            f"--data.dataset_kwargs={SMALL_GRAPH}",
            f"--trainer.max_epochs={epochs}",
            f"--trainer.default_root_dir={runs}",
            *QUIET,
        ],
        tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output, "the second rank did not start"
    assert "final metrics after" in proc.stdout and "test_acc" in proc.stdout

    scalars = _scalars(runs)
    assert "train_loss" in scalars and "val_acc" in scalars, sorted(scalars)
    assert len(scalars["train_loss"]) == epochs
    assert all(0.0 <= v <= 1.0 for v in scalars["val_acc"])
    assert "test_acc" in scalars
    assert any(tag.startswith("comm/") for tag in scalars), "the strategy's traffic counters were not logged"
    # LightningCLI saved the resolved config next to the events, and the last checkpoint.
    (saved,) = list(runs.rglob("config.yaml"))
    strategy = yaml.safe_load(saved.read_text())["trainer"]["strategy"]
    if config == "strategy_class_path.yaml":
        assert strategy["class_path"] == "lightning_fullgraph.FullGraphStrategy"
        assert strategy["init_args"]["timeout"] == "0:01:00"
    else:
        assert strategy == "fullgraph_quant"
    assert list(runs.rglob("*.ckpt")), "no checkpoint written"


@pytest.mark.timeout(120)
def test_partition_subcommand_then_fit(tmp_path, capsys):
    """`partition` builds then reuses the cache; `fit --data.data=<folder>` trains on it."""
    cache = tmp_path / "cache"
    args = ["partition", "--data", "community", "--num-parts", "1", "--cache-dir", str(cache)]
    args += ["--dataset-kwargs", json.dumps({"num_nodes": 400, "num_val": 100, "num_test": 100})]

    assert main(args) == 0
    first = capsys.readouterr().out
    assert "status: built in" in first
    folder = Path(
        next(line for line in first.splitlines() if line.startswith("partition folder:")).split(": ", 1)[1]
    )
    assert (folder / "manifest.json").is_file() and folder.parent == cache.resolve()
    for column in ("owned", "halo", "local_edges", "cut_fraction"):
        assert column in first
    assert "total" in first

    assert main(args) == 0
    second = capsys.readouterr().out
    assert "status: cache hit" in second
    assert f"partition folder: {folder}" in second

    # Machine-readable output, 2 parts: statistics add up.
    assert main([*args[:4], "2", *args[5:], "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_parts"] == 2 and summary["cache_hit"] is False
    parts = summary["parts"]
    assert sum(p["owned"] for p in parts) == summary["num_nodes"] == 400
    assert sum(p["local_edges"] for p in parts) == summary["num_edges"]
    assert all(p["halo"] > 0 and 0 < p["cut_fraction"] < 1 for p in parts)

    # The folder is a `--data.data` value: one rank in-process (no popen re-run of pytest).
    main(
        ["fit", f"--data.data={folder}", "--trainer.devices=1", "--trainer.max_epochs=3"]
        + QUIET
        + [
            f"--trainer.default_root_dir={tmp_path / 'runs'}",
        ]
    )
    out = capsys.readouterr().out
    assert "final metrics after 3 epoch(s)" in out and "val_acc" in out and "test_acc" in out


def test_partition_suggests_the_allocator_environment_for_large_parts(tmp_path, capsys, monkeypatch):
    """`partition` prints the allocator environment (`THP_MEM_ALLOC_ENABLE=1
    MALLOC_MMAP_THRESHOLD_=2097152`) when its largest part holds at least
    `LARGE_PART_ROWS` rows and the environment lacks it; it names only the missing variables,
    and says nothing for small parts or when both are set.  Negative control: without the
    `print(hint)` in `_partition` the first assertion fails; a hint printed regardless of the
    part size or the environment fails the later ones."""
    import lightning_fullgraph.cli.partition as cli

    args = ["partition", "--data", "community", "--num-parts", "2", "--cache-dir", str(tmp_path)]
    args += ["--dataset-kwargs", json.dumps({"num_nodes": 400, "num_val": 100, "num_test": 100})]
    for key in cli.ALLOCATOR_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(cli, "LARGE_PART_ROWS", 150)  # both parts: 200 owned rows plus a halo
    assert main(args) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("on CPU:")]
    assert len(hint) == 1 and "THP_MEM_ALLOC_ENABLE=1 MALLOC_MMAP_THRESHOLD_=2097152" in hint[0]

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert main(args) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("on CPU:")]
    assert len(hint) == 1 and "`MALLOC_MMAP_THRESHOLD_=2097152`" in hint[0]

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "2097152")
    assert main(args) == 0
    assert "on CPU:" not in capsys.readouterr().out

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    monkeypatch.setattr(cli, "LARGE_PART_ROWS", 10**6)
    assert main(args) == 0
    assert "on CPU:" not in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_partition_balance_flag_and_imbalance(tmp_path, capsys):
    """`--balance` reaches the cache key and the output; table and JSON report per-part nodes and
    edges and the max/mean imbalance of both.

    Negative control: without the flag passed through, `--balance nodes` would be a cache hit on
    the default (edges) folder and report `"balance": "edges"`; without the summary line / JSON
    fields the regex and key lookups below fail."""
    import re

    cache = tmp_path / "cache"
    base = ["partition", "--data", "community", "--num-parts", "2", "--cache-dir", str(cache)]
    base += ["--dataset-kwargs", json.dumps({"num_nodes": 400, "num_val": 100, "num_test": 100})]

    summaries = {}
    for balance in ("nodes", "edges"):
        assert main([*base, "--balance", balance, "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["balance"] == balance and summary["cache_hit"] is False
        parts = summary["parts"]
        nodes = [p["owned"] for p in parts]
        edges = [p["local_edges"] for p in parts]
        assert summary["nodes_per_part"] == nodes and summary["edges_per_part"] == edges
        assert sum(nodes) == summary["num_nodes"] and sum(edges) == summary["num_edges"]
        assert summary["node_imbalance"] == pytest.approx(max(nodes) / (sum(nodes) / 2))
        assert summary["edge_imbalance"] == pytest.approx(max(edges) / (sum(edges) / 2))
        assert summary["edge_imbalance"] <= 1.1
        summaries[balance] = summary
    assert summaries["nodes"]["folder"] != summaries["edges"]["folder"]

    assert main(base) == 0  # default balance = edges: a cache hit on the second folder
    out = capsys.readouterr().out
    assert "status: cache hit" in out and "balance edges" in out
    match = re.search(r"^imbalance: nodes max/mean (\d+\.\d+), edges max/mean (\d+\.\d+)$", out, re.M)
    assert match, out
    assert float(match.group(1)) == pytest.approx(summaries["edges"]["node_imbalance"], abs=1e-3)
    assert float(match.group(2)) == pytest.approx(summaries["edges"]["edge_imbalance"], abs=1e-3)

    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--balance", "degree"])
    assert exit_info.value.code == 2 and "edges" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_optimizer_flag_with_lazily_built_model(tmp_path, capsys):
    """`--optimizer` works although GNNNodeClassifier creates its layers in configure_model."""
    main(
        [
            "fit",
            f"--data.dataset_kwargs={SMALL_GRAPH}",
            "--trainer.devices=1",
            "--trainer.max_epochs=2",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--test_after_fit=false",
            "--optimizer=SGD",
            "--optimizer.lr=0.05",
            "--lr_scheduler=StepLR",
            "--lr_scheduler.step_size=1",
            *QUIET,
        ]
    )
    out = capsys.readouterr().out
    assert "final metrics after 2 epoch(s)" in out and "test_acc" not in out


@pytest.mark.timeout(60)
def test_predict_saves_global_predictions(tmp_path):
    path = tmp_path / "preds.pt"
    main(
        [
            "predict",
            f"--data.dataset_kwargs={SMALL_GRAPH}",
            "--trainer.devices=1",
            "--trainer.logger=false",
            f"--predictions_path={path}",
            *QUIET,
        ]
    )
    preds = torch.load(path)
    assert preds.shape == (1000, 5)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda p: p.name)
def test_example_configs_parse(config, capsys):
    """Every example config passes `fit --print_config` and instantiates its classes."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    devices = printed["trainer"]["devices"]
    # the big-graph configs ask for 4 devices and let Lightning pick the accelerator
    assert devices in (2, 4) and printed["trainer"]["accelerator"] in ("cpu", "auto")
    assert printed["model"]["class_path"] == "lightning_fullgraph.models.GNNNodeClassifier"

    # Instantiate model, datamodule and trainer (strategy included) without running anything.
    cli = FullGraphCLI(args=["--config", str(config)], run=False)
    assert isinstance(cli.model, GNNNodeClassifier)
    assert isinstance(cli.trainer.strategy, FullGraphStrategy)
    assert cli.trainer.world_size == devices
    if config.name == "strategy_class_path.yaml":
        assert cli.trainer.strategy._timeout == timedelta(minutes=1)
        assert cli.trainer.strategy._start_method == "popen"


@pytest.mark.parametrize(
    ("strategy_args", "mode", "bits"),
    [
        (["--trainer.strategy=fullgraph_exact"], "exact", None),
        (["--trainer.strategy=fullgraph_adaqp"], "adaqp", "adaptive"),
        (["--trainer.strategy=fullgraph_sylvie"], "sylvie", 1),
        (["--trainer.strategy=fullgraph_quant"], "adaqp", "adaptive"),
        (["--trainer.strategy=lightning_fullgraph.FullGraphStrategy", "--trainer.strategy.mode=sylvie",
          "--trainer.strategy.bits=adaptive", "--trainer.strategy.staleness=3"], "sylvie", "adaptive"),
    ],
)
def test_every_strategy_name_and_the_combination_from_the_cli(strategy_args, mode, bits, tmp_path):
    """The four registered names and ``mode=sylvie, bits=adaptive`` instantiate from the CLI /
    YAML with the policy they name. Negative control: without the ``fullgraph_adaqp`` /
    ``fullgraph_sylvie`` registrations Lightning refuses the names."""
    cli = FullGraphCLI(args=strategy_args + [f"--data.cache_dir={tmp_path}"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, FullGraphStrategy)
    assert (strategy.mode, strategy.bits) == (mode, bits)
    if len(strategy_args) > 1:
        assert strategy.staleness == 3


def test_defaults_need_no_config(capsys):
    """`fit` with no arguments: 2 CPU ranks, fullgraph_quant, GNNNodeClassifier, community."""
    with pytest.raises(SystemExit):
        main(["fit", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"] == "fullgraph_quant"
    assert (config["trainer"]["accelerator"], config["trainer"]["devices"]) == ("cpu", 2)
    assert config["model"]["class_path"] == "lightning_fullgraph.models.GNNNodeClassifier"
    assert config["data"]["data"] == "community"
    assert config["seed_everything"] == 0


def test_help_lists_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "partition"):
        assert f"  {name} " in out
    with pytest.raises(SystemExit) as exit_info:
        main(["partition", "--help"])
    assert exit_info.value.code == 0
    partition_help = capsys.readouterr().out
    assert "--num-parts" in partition_help and "--balance {edges,nodes}" in partition_help
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    assert "--test_after_fit" in capsys.readouterr().out
