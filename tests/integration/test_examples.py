"""``examples/``: every config parses, the offline ones train, the scripts run, OGB/ROC-AUC metrics.

* Every YAML under ``examples/configs`` passes ``fit --print_config`` with its values intact and
  instantiates (model, datamodule, trainer); the (dataset x conv) grid is complete.
* The offline configs (generated ``community`` graph; Cora, CiteSeer and tolokers from
  ``../shared/datasets``, skipped with the reason where it is absent) train one epoch on 2 CPU
  ranks in-process through :func:`lightning_fullgraph.cli.main`, then test.  The popen
  launcher would re-run pytest, so the strategy is overridden to start its ranks with ``fork``
  (same mode as the config's).
* ``examples/train_custom_module.py`` runs as a user runs it (a subprocess; popen launcher);
  ``examples/train_node_classifier.py`` in-process with ``--start-method fork``.
* ``GNNNodeClassifier(ogb_evaluator=...)`` on 2 ranks equals the torchmetrics accuracy and
  OGB's Evaluator on single-process predictions; ``metric="rocauc"`` equals torchmetrics'
  AUROC on single-process predictions (binary and multiclass).

Everything runs with cwd = tmp_path, so nothing is written into the repository.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.strategies import StrategyRegistry
from torchmetrics.classification import BinaryAUROC, MulticlassAUROC

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
from lightning_fullgraph.cli import main
from lightning_fullgraph.cli.train import FullGraphCLI
from lightning_fullgraph.data.datasets import community_graph
from lightning_fullgraph.models import GNNNodeClassifier
from tests.conftest import REPO, free_port
from tests.helpers import cpu_trainer
from tests.processes import run_process

EXAMPLES = REPO / "examples"
CONFIGS = EXAMPLES / "configs"
ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
DATASETS = ("community", "cora", "citeseer", "tolokers", "ogbn_arxiv", "ogbn_products", "reddit")
CONVS = ("gcn", "sage", "gat")
OFFLINE = {"community", "Cora", "CiteSeer", "tolokers"}  # data.data values that need no download
SHARED_PREFIX = "../shared/datasets/"

# One-epoch runs: a small generated graph, no logger/checkpoints, quiet.
SMALL_GRAPH = {"num_nodes": 600, "num_val": 200, "num_test": 200}
RUN_FLAGS = [
    "--trainer.max_epochs=1",
    "--trainer.devices=2",
    "--trainer.accelerator=cpu",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.num_sanity_val_steps=0",
    # With a fork/spawn launcher the CLI's SaveConfigCallback runs again in the children of
    # test_after_fit's trainer.test and refuses to overwrite the config.yaml fit wrote; the
    # test path is covered by the trainer.test calls below.
    "--test_after_fit=false",
]


def _config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _is_offline(path: Path) -> bool:
    return _config(path)["data"]["data"] in OFFLINE


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    """cwd = tmp_path: LightningCLI writes config.yaml / lightning_logs into the working directory.
    sys.argv without pytest's arguments: in-process CLI calls pass theirs explicitly."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-fullgraph"])


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One processed-dataset cache for the module (Cora is processed once, not per config)."""
    return tmp_path_factory.mktemp("datasets")


# ------------------------------------------------------------------------------ the grid
def test_every_dataset_and_conv_has_a_config():
    names = {p.name for p in ALL_CONFIGS}
    missing = [f"{d}_{c}.yaml" for d in DATASETS for c in CONVS if f"{d}_{c}.yaml" not in names]
    assert not missing, f"missing example configs: {missing}"
    for dataset in DATASETS:
        for conv in CONVS:
            config = _config(CONFIGS / f"{dataset}_{conv}.yaml")
            init = config["model"]["init_args"]
            assert init["conv"] == conv
            assert config["data"]["data"].lower().replace("-", "_") == dataset
            if dataset.startswith("ogbn"):
                assert init["ogb_evaluator"] == config["data"]["data"], "OGB configs report OGB's Evaluator"
            if dataset == "tolokers":
                assert init["metric"] == "rocauc"
            if dataset in ("ogbn_arxiv", "ogbn_products", "reddit"):
                assert config["trainer"]["devices"] == 4
                assert (init["num_layers"], init["hidden_channels"], init["layer_norm"]) == (3, 256, True)
    # The compressed modes, with their options through class_path / init_args.
    adaqp = _config(CONFIGS / "community_gcn_adaqp.yaml")["trainer"]["strategy"]["init_args"]
    assert adaqp["mode"] == "adaqp" and {"bits", "assign_every", "lambda_", "group_size"} <= adaqp.keys()
    sylvie = _config(CONFIGS / "community_sage_sylvie.yaml")["trainer"]["strategy"]["init_args"]
    assert sylvie["mode"] == "sylvie" and {"staleness", "smoothing"} <= sylvie.keys()


# ----------------------------------------------------------------------- every config parses
def _assert_subset(given, printed, where: str) -> None:
    """Every value the config file sets is in the printed (resolved) config unchanged."""
    if isinstance(given, dict):
        assert isinstance(printed, dict), f"{where}: {printed!r}"
        for key, value in given.items():
            assert key in printed, f"{where}.{key} was dropped"
            _assert_subset(value, printed[key], f"{where}.{key}")
    elif isinstance(given, float) or isinstance(printed, float):
        assert float(printed) == pytest.approx(float(given)), where
    else:
        assert printed == given, f"{where}: config {given!r}, printed {printed!r}"


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_instantiates(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    _assert_subset(_config(config), printed, config.name)

    # Model (the OGB evaluator name is checked here), datamodule and trainer; nothing runs
    # and no dataset is loaded.
    cli = FullGraphCLI(args=["--config", str(config)], run=False)
    assert isinstance(cli.model, GNNNodeClassifier)
    assert isinstance(cli.datamodule, FullGraphDataModule)
    assert isinstance(cli.trainer.strategy, FullGraphStrategy)
    assert cli.trainer.world_size == printed["trainer"]["devices"]


# ------------------------------------------------------------- offline configs, one epoch
def _one_epoch_args(config: Path, shared: Path | None) -> list[str]:
    values = _config(config)
    args = ["fit", "--config", str(config), *RUN_FLAGS]
    strategy = values["trainer"]["strategy"]
    if isinstance(strategy, str):  # a registry name: the same mode, through the class
        mode = StrategyRegistry[strategy]["init_params"]["mode"]
        args += ["--trainer.strategy=lightning_fullgraph.FullGraphStrategy", f"--trainer.strategy.mode={mode}"]
    args += ["--trainer.strategy.start_method=fork", "--trainer.strategy.timeout=0:02:00"]
    data = values["data"]
    if data["data"] == "community":
        args.append(f"--data.dataset_kwargs={json.dumps(SMALL_GRAPH)}")
    root = data.get("root")
    if root is not None:
        assert shared is not None and root.startswith(SHARED_PREFIX), f"{config.name}: root {root}"
        args.append(f"--data.root={shared / root[len(SHARED_PREFIX):]}")
    return args


OFFLINE_CONFIGS = [p for p in ALL_CONFIGS if _is_offline(p)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", OFFLINE_CONFIGS, ids=lambda p: p.name)
def test_offline_config_trains_one_epoch(config, request, monkeypatch, data_cache, capsys):
    values = _config(config)
    shared = None
    if values["data"]["data"] != "community":
        shared = request.getfixturevalue("shared_datasets")  # skips with the reason where absent
    monkeypatch.setenv("LIGHTNING_FULLGRAPH_DATA_CACHE", str(data_cache))
    main(_one_epoch_args(config, shared))
    out = capsys.readouterr().out
    # (the parent of forked ranks prints "after 0 epoch(s)": the fork launcher does not
    # bring the epoch counter back, only the metrics)
    assert "final metrics after" in out, out
    assert "train_loss" in out and "val_acc" in out
    if values["model"]["init_args"].get("metric") == "rocauc":
        assert "val_rocauc" in out
    assert (Path.cwd() / "config.yaml").is_file(), "LightningCLI saves the resolved config in the cwd"


def test_offline_configs_cover_every_offline_dataset_and_conv():
    covered = {(_config(p)["data"]["data"], _config(p)["model"]["init_args"]["conv"]) for p in OFFLINE_CONFIGS}
    assert covered >= {(d, c) for d in OFFLINE for c in CONVS}


# ------------------------------------------------------------------------------- scripts
def _user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.pop("PL_GLOBAL_SEED", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["LIGHTNING_FULLGRAPH_CACHE"] = str(tmp_path / "partitions")
    return env


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_custom_module_script(tmp_path):
    """`python examples/train_custom_module.py` as a user runs it: 2 ranks, popen launcher."""
    proc = run_process(
        [sys.executable, str(EXAMPLES / "train_custom_module.py"), "--max-epochs", "3"],
        cwd=tmp_path,
        env=_user_env(tmp_path),
        merge_stderr=False,
        timeout=170,
    )
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stdout + proc.stderr, "the second rank did not start"
    assert "val accuracy:" in proc.stdout and "test accuracy:" in proc.stdout


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_train_node_classifier_script(capsys):
    script = _load_script("train_node_classifier")
    metrics = script.main(
        ["--conv", "sage", "--max-epochs", "2", "--start-method", "fork",
         "--dataset-kwargs", json.dumps(SMALL_GRAPH)]
    )
    assert {"val_acc", "test_acc"} <= metrics.keys()
    assert "community sage (adaqp, 2 ranks, 2 epochs)" in capsys.readouterr().out
    # The OGB / tolokers settings name the evaluator / metric the configs use.
    assert script.model_kwargs("ogbn-arxiv", "gat")["ogb_evaluator"] == "ogbn-arxiv"
    assert script.model_kwargs("tolokers", "gcn")["metric"] == "rocauc"


# --------------------------------------------------------------- OGB Evaluator, ROC-AUC
def _trained(graph, world_size: int = 2, epochs: int = 5, **model_kwargs):
    """GNNNodeClassifier built lazily (sizes from the datamodule), trained on forked ranks."""
    pl.seed_everything(0)
    model = GNNNodeClassifier(conv="gcn", hidden_channels=16, dropout=0.0, **model_kwargs)
    dm = FullGraphDataModule(graph)
    trainer = cpu_trainer(
        world_size, max_epochs=epochs, limit_val_batches=1.0, num_sanity_val_steps=1,
        strategy=FullGraphStrategy(mode="exact", start_method="fork", timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, datamodule=dm)
    val = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (test,) = trainer.test(model, datamodule=dm, verbose=False)
    return model, val, test


def _single_process_logits(model: GNNNodeClassifier, graph) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(graph.x, graph.edge_index)


@pytest.mark.timeout(120)
def test_ogb_evaluator_on_two_ranks_matches_torchmetrics_and_single_process():
    from ogb.nodeproppred import Evaluator

    graph = community_graph(num_nodes=600, num_val=150, num_test=250, seed=1)
    model, val, test = _trained(graph, ogb_evaluator="ogbn-arxiv")
    # Gathered from both ranks and scored by OGB's Evaluator == torchmetrics' synced accuracy.
    assert val["val_ogb_acc"] == pytest.approx(val["val_acc"], abs=1e-6)
    assert test["test_ogb_acc"] == pytest.approx(test["test_acc"], abs=1e-6)
    assert 0.3 < test["test_acc"] < 1.0, "trained, not chance (5 classes)"

    # The parent's module holds rank 0's trained weights (built from them: it never ran
    # configure_model); exact mode makes single-process inference equal the distributed one.
    assert model.convs is not None and model.hparams.num_classes == 5
    pred = _single_process_logits(model, graph).argmax(-1)
    evaluator = Evaluator("ogbn-arxiv")
    for split, mask in (("val", graph.val_mask), ("test", graph.test_mask)):
        reference = evaluator.eval({"y_true": graph.y[mask].view(-1, 1), "y_pred": pred[mask].view(-1, 1)})["acc"]
        logged = val["val_ogb_acc"] if split == "val" else test["test_ogb_acc"]
        assert logged == pytest.approx(reference, abs=1e-6), split


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_classes", [2, 4])
def test_rocauc_on_two_ranks_matches_single_process(num_classes):
    graph = community_graph(num_nodes=600, num_classes=num_classes, num_val=150, num_test=250, seed=2)
    model, val, test = _trained(graph, epochs=3, metric="rocauc")
    assert {"val_acc", "val_rocauc"} <= val.keys() and {"test_acc", "test_rocauc"} <= test.keys()
    probs = _single_process_logits(model, graph).softmax(-1)
    mask = graph.test_mask
    if num_classes == 2:
        reference = BinaryAUROC()(probs[mask, 1], graph.y[mask])
    else:
        reference = MulticlassAUROC(num_classes, average="macro")(probs[mask], graph.y[mask])
    assert test["test_rocauc"] == pytest.approx(float(reference), abs=1e-5)


def test_metric_and_evaluator_arguments_are_checked():
    with pytest.raises(ValueError, match="metric="):
        GNNNodeClassifier(metric="f1")
    with pytest.raises(ValueError, match="not an OGB node-property dataset"):
        GNNNodeClassifier(ogb_evaluator="ogbn-nonexistent")
    with pytest.raises(ValueError, match="rocauc"):
        GNNNodeClassifier(ogb_evaluator="ogbn-proteins")  # multi-label ROC-AUC: not this model's output
    # Defaults unchanged: accuracy only, no evaluator.
    model = GNNNodeClassifier(in_channels=4, num_classes=3)
    assert model.hparams.metric == "accuracy" and model.hparams.ogb_evaluator is None
    assert model.val_rocauc is None and model.test_rocauc is None
