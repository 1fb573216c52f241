"""The launcher's checks before any rank starts (``lightning_fullgraph.launch.preflight``) and the
rule deciding which rank of a popen run reports a failure (``launch.report.claim_report``).

No process is started here: a Trainer is only constructed, and the trainer functions are
read, never called."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import lightning.pytorch as pl
import pytest
from torch import nn
from torch_geometric.nn import ChebConv, GCNConv, MessagePassing

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy, UnsupportedConvError
from lightning_fullgraph.data.validation import GraphValidationError
from lightning_fullgraph.launch import report
from lightning_fullgraph.launch.preflight import (
    check_before_launch,
    check_convs,
    check_data,
    launch_target,
    require_datamodule,
    world_size,
)
from lightning_fullgraph.nn.patch import install_adapters
from tests.helpers import NodeClassifier, directed_graph


def _trainer(devices: int = 2, **strategy: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=FullGraphStrategy(start_method="fork", timeout=timedelta(seconds=30), **strategy),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _without_train_mask():
    data = directed_graph()
    del data.train_mask
    return data


class _Cheb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(GCNConv(8, 8), nn.ReLU(), nn.Sequential(ChebConv(8, 3, K=2)))


class _Custom(MessagePassing):
    """A user's conv without an adapter."""

    def forward(self, x, edge_index):
        return self.propagate(edge_index, x=x)


# -- world size ---------------------------------------------------------------------------
def test_the_world_size_is_nodes_times_devices() -> None:
    """Negative control: ``world_size`` without ``num_nodes`` gives 3."""
    trainer = pl.Trainer(accelerator="cpu", devices=3, num_nodes=2, strategy="fullgraph_exact", logger=False)
    assert world_size(trainer.strategy) == 6


# -- datamodule -----------------------------------------------------------------------------
def test_only_a_fullgraph_datamodule_is_accepted(tmp_path) -> None:
    """Negative control: a ``require_datamodule`` that returns its argument fails both
    ``raises``."""
    dm = FullGraphDataModule(directed_graph(), cache_dir=tmp_path)
    assert require_datamodule(dm) is dm
    with pytest.raises(TypeError, match=r"needs a FullGraphDataModule.*\(got no datamodule\)"):
        require_datamodule(None)
    with pytest.raises(TypeError, match=r"\(got LightningDataModule\)"):
        require_datamodule(pl.LightningDataModule())


# -- graph ----------------------------------------------------------------------------------
def test_a_graph_without_train_mask_is_refused_with_the_fix(tmp_path) -> None:
    """Negative control: ``check_data`` not validating the graph fails the ``raises``."""
    dm = FullGraphDataModule(_without_train_mask(), cache_dir=tmp_path)
    with pytest.raises(GraphValidationError, match=r"train_mask is missing.*add a bool mask"):
        check_data(dm, 2, load_graph=True)
    check_data(FullGraphDataModule(_without_train_mask(), require_train=False), 2, load_graph=True)


def test_the_graph_is_not_loaded_where_it_may_not_be(tmp_path) -> None:
    """``load_graph=False`` (a spawned rank would get a pickled copy) and a ``mask_key`` that
    changes which masks are selected leave the graph to ``prepare_data``; parts are checked
    regardless.  Negative control: loading regardless fails the ``_graph is None`` checks."""
    dm = FullGraphDataModule("community", dataset_kwargs={"num_nodes": 200}, cache_dir=tmp_path)
    check_data(dm, 2, load_graph=False)
    assert dm._graph is None
    check_data(dm, 2, load_graph=True, mask_key="labelled")
    assert dm._graph is None
    with pytest.raises(ValueError, match="num_parts"):
        check_data(FullGraphDataModule("community", num_parts=4), 2, load_graph=False)
    check_data(dm, 2, load_graph=True, mask_key="labelled_mask")
    assert dm._graph is not None  # loaded once, cached for prepare_data


def test_a_partition_folder_with_other_parts_is_refused(tmp_path) -> None:
    """Negative control: skipping the manifest check fails the ``raises``."""
    from lightning_fullgraph.partition.cache import PartitionCacheError, ensure_partitions

    folder = ensure_partitions(directed_graph(), 2, cache_root=tmp_path).folder
    check_data(FullGraphDataModule(str(folder)), 2, load_graph=True)
    with pytest.raises(PartitionCacheError, match="num_parts is 2"):
        check_data(FullGraphDataModule(str(folder)), 3, load_graph=False)


# -- convs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module", [_Cheb, lambda: nn.Sequential(nn.Sequential(_Custom()))], ids=["cheb", "custom"]
)
def test_an_unsupported_conv_gets_the_setup_error(module) -> None:
    """The same class and message as ``install_adapters`` at setup, and nothing is patched.
    Negative control (run): ``check_convs`` walking ``module.children()`` (the top level
    only) instead of ``module.modules()`` misses the nested conv."""
    with pytest.raises(UnsupportedConvError) as at_setup:
        install_adapters(module(), ctx=None)  # refused before the context is used
    model = module()
    with pytest.raises(UnsupportedConvError) as found:
        check_convs(model)
    assert str(found.value) == str(at_setup.value)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_supported_convs_pass() -> None:
    check_convs(NodeClassifier(conv="gcn"))
    check_convs(NodeClassifier(conv="gat"))
    check_convs(nn.Linear(2, 2))


# -- what launch is given -------------------------------------------------------------------
def test_the_model_and_datamodule_are_read_from_every_trainer_function(tmp_path) -> None:
    """Lightning calls ``launch`` before attaching model and data: they come from the
    arguments (fit's datamodule may come as ``train_dataloaders``; validate/test/predict
    without a model use the attached one).  Negative control: reading ``trainer.datamodule``
    only gives ``None`` for every call below."""
    trainer = _trainer()
    model, dm = NodeClassifier(), FullGraphDataModule(directed_graph(), cache_dir=tmp_path)
    assert launch_target(trainer, trainer._fit_impl, (model, None, None, dm, None, None), {}) == (model, dm)
    assert launch_target(trainer, trainer._fit_impl, (model, dm, None, None, None, None), {}) == (model, dm)
    trainer.strategy._lightning_module = model
    assert launch_target(trainer, trainer._validate_impl, (None, None, None, True, dm, None), {}) == (
        model,
        dm,
    )
    assert launch_target(trainer, trainer._test_impl, (model, dm, None, True, None, None), {}) == (model, dm)
    assert launch_target(trainer, trainer._predict_impl, (model, None, dm, True, None, None), {}) == (
        model,
        dm,
    )
    assert launch_target(trainer, lambda: None, (), {}) is None


def test_check_before_launch_raises_what_the_ranks_would(tmp_path) -> None:
    """Parts, the datamodule, the graph and the convs, in the launching process.  Negative
    control: an empty ``check_before_launch`` fails every ``raises``."""
    trainer = _trainer(devices=2)

    def fit(model, dm) -> None:
        check_before_launch(
            trainer, trainer._fit_impl, (model, None, None, dm, None, None), {}, load_graph=True
        )

    with pytest.raises(ValueError, match="num_parts=3"):
        fit(NodeClassifier(), FullGraphDataModule(directed_graph(), num_parts=3, cache_dir=tmp_path))
    with pytest.raises(TypeError, match="needs a FullGraphDataModule"):
        fit(NodeClassifier(), None)
    with pytest.raises(GraphValidationError, match="train_mask is missing"):
        fit(NodeClassifier(), FullGraphDataModule(_without_train_mask(), cache_dir=tmp_path))
    with pytest.raises(UnsupportedConvError, match="ChebConv"):
        fit(_Cheb(), FullGraphDataModule(directed_graph(), cache_dir=tmp_path))
    dm = FullGraphDataModule(directed_graph(), cache_dir=tmp_path)
    fit(NodeClassifier(), dm)
    check_before_launch(None, trainer._fit_impl, (), {}, load_graph=True)  # no trainer: nothing


def test_a_node_that_does_not_prepare_data_does_not_load_the_graph(tmp_path) -> None:
    """With ``prepare_data_per_node=False`` only node 0 loads the graph (as in
    ``prepare_data``).  Negative control: ignoring ``node_rank`` raises on node 1."""
    trainer = _trainer(devices=2)
    dm = FullGraphDataModule(_without_train_mask(), cache_dir=tmp_path)
    dm.prepare_data_per_node = False
    args = (NodeClassifier(), None, None, dm, None, None)
    check_before_launch(trainer, trainer._fit_impl, args, {}, load_graph=True, node_rank=1)
    with pytest.raises(GraphValidationError):
        check_before_launch(trainer, trainer._fit_impl, args, {}, load_graph=True, node_rank=0)


# -- which rank reports a failure -------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(report.RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return tmp_path


def _reported_by_another_rank(run_dir, error: BaseException) -> None:
    (run_dir / "reported").write_text(
        f'{{"pid": {os.getpid() + 100000}, "rank": 1, "error": "{type(error).__name__}: {error}"}}'
    )


def test_the_first_rank_to_fail_reports(run_dir) -> None:
    """Negative control: a ``claim_report`` without the atomic link reports twice."""
    error = ValueError("bad lr")
    assert report.claim_report(error, rank=0)
    assert (run_dir / "reported").exists()
    assert report.claim_report(error, rank=0)  # this process again: still its report
    assert not report.reported_elsewhere()


@pytest.mark.parametrize(
    "error",
    [RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), ValueError("bad lr")],
    ids=["lost-peer", "same-error"],
)
def test_a_peer_of_the_reporting_rank_stays_quiet(run_dir, capsys, error) -> None:
    """A rank that lost the reporting rank, or raised the same error, prints nothing for it
    (its uncaught exception ends it with status 1); code catching it still gets it.
    Negative control: ``claim_report`` always True fails the first assert."""
    _reported_by_another_rank(run_dir, ValueError("bad lr"))
    assert report.reported_elsewhere()
    assert not report.claim_report(error, rank=0)
    sys.excepthook(type(error), error, None)
    assert capsys.readouterr().err == ""
    other = KeyError("another error")
    sys.excepthook(type(other), other, None)
    assert "another error" in capsys.readouterr().err


def test_a_different_error_or_an_unreported_lost_peer_is_reported(run_dir) -> None:
    """A second, different error is not hidden; a lost peer nobody reported (a killed rank)
    is reported (with the halo-exchange paragraph).  Negative control: quiet on any report
    hides the ``TypeError``."""
    lost = RuntimeError("Connection closed by peer")
    assert report.claim_report(lost, rank=1)
    _reported_by_another_rank(run_dir, ValueError("bad lr"))
    assert report.claim_report(TypeError("something else"), rank=0)


def test_without_a_run_folder_every_rank_reports(monkeypatch) -> None:
    monkeypatch.delenv(report.RUN_DIR_ENV, raising=False)
    assert report.claim_report(RuntimeError("Connection closed by peer"), rank=1)


def test_lost_peer_errors() -> None:
    assert report.is_lost_peer(RuntimeError("Connection closed by peer"))
    assert report.is_lost_peer(RuntimeError("[gloo] Timed out waiting 30000ms"))
    assert not report.is_lost_peer(ValueError("num_parts=2"))


def test_old_run_folders_of_exited_launchers_are_removed(tmp_path, monkeypatch) -> None:
    """Negative control: ``make_run_dir`` without its clean-up leaves ``stale``."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / f"{report.RUN_DIR_PREFIX}999999999-x"
    live = tmp_path / f"{report.RUN_DIR_PREFIX}{os.getpid()}-y"
    for folder in (stale, live):
        folder.mkdir()
        os.utime(folder, (0, 0))
    made = report.make_run_dir()
    assert os.path.isdir(made) and os.path.basename(made).startswith(
        f"{report.RUN_DIR_PREFIX}{os.getpid()}-"
    )
    assert not stale.exists() and live.exists()
