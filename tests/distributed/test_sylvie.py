"""Sylvie mode: bounded staleness is respected, eps=1 at 32 bits is exact, clean shutdowns."""

from __future__ import annotations

import copy
import threading
import time

import lightning.pytorch as pl
import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph, reference_training

pytestmark = pytest.mark.timeout(120)


class _CheckStaleness(pl.Callback):
    """Runs inside every rank: asserts the age of every consumed halo block."""

    def __init__(self, eps: int) -> None:
        self.eps = eps

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        st = trainer.strategy.exchanger.staleness
        epoch = trainer.current_epoch
        assert st.ages, "no halo was consumed"
        sync = epoch % self.eps == 0
        for e, layer, age in st.ages:
            assert e == epoch
            assert 0 <= age <= self.eps - 1, f"epoch {epoch} layer {layer} used a value {age} epochs old"
            if sync:
                assert age == 0, f"synchronous epoch {epoch} used stale values"
        if epoch > 0 and not sync:
            assert all(age == 1 for _, _, age in st.ages)


@pytest.mark.parametrize("eps", [1, 2, 5])
def test_no_value_older_than_the_bound_is_used(eps: int, tmp_path) -> None:
    data = directed_graph(seed=21)
    trainer = cpu_trainer(3, max_epochs=7, callbacks=[_CheckStaleness(eps)],
                          strategy_kwargs={"mode": "sylvie", "staleness": eps})
    trainer.fit(NodeClassifier(conv="sage", num_layers=3), datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    assert float(trainer.callback_metrics["comm/bits"]) == 1.0
    assert float(trainer.callback_metrics["comm/staleness_max"]) <= eps - 1


@pytest.mark.parametrize("conv", ["gcn", "sage"])
def test_eps_one_with_32_bit_messages_equals_exact(conv: str, tmp_path) -> None:
    data = directed_graph(seed=22)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, num_layers=3)
    expected = reference_training(copy.deepcopy(model), data, 4)
    trainer = cpu_trainer(3, max_epochs=4, strategy_kwargs={"mode": "sylvie", "staleness": 1, "bits": 32})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    for key in expected:
        torch.testing.assert_close(model.state_dict()[key], expected[key])


def test_async_epochs_actually_differ_from_exact(tmp_path) -> None:
    """Sanity check of the test above: with staleness the weights do move differently."""
    data = directed_graph(seed=22)
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3)
    expected = reference_training(copy.deepcopy(model), data, 4)
    trainer = cpu_trainer(3, max_epochs=4, strategy_kwargs={"mode": "sylvie", "staleness": 4, "bits": 32})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
    assert any(not torch.allclose(model.state_dict()[k], expected[k]) for k in expected)


class _ThreadCheck(pl.Callback):
    def setup(self, trainer, pl_module, stage) -> None:
        self.before = {t.ident for t in threading.enumerate()}

    def teardown(self, trainer, pl_module, stage) -> None:
        leaked = [t.name for t in threading.enumerate() if t.ident not in self.before and t.is_alive()]
        assert not leaked, f"threads left behind: {leaked}"


class _StopEarly(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            trainer.should_stop = True


def test_early_stop_ends_cleanly(tmp_path) -> None:
    start = time.monotonic()
    trainer = cpu_trainer(2, max_epochs=50, callbacks=[_StopEarly(), _ThreadCheck()],
                          strategy_kwargs={"mode": "sylvie", "staleness": 5})
    trainer.fit(NodeClassifier(conv="gcn"), datamodule=FullGraphDataModule(directed_graph(), cache_dir=tmp_path))
    assert time.monotonic() - start < 60


class _Explodes(NodeClassifier):
    def training_step(self, batch, batch_idx):
        if self.current_epoch == 3 and self.global_rank == 0:
            raise RuntimeError("boom in an asynchronous epoch")
        return super().training_step(batch, batch_idx)


def test_exception_in_an_async_epoch_fails_fast(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(Exception, match="boom in an asynchronous epoch|Connection closed by peer|another rank stopped"):
        cpu_trainer(2, max_epochs=6, strategy_kwargs={"mode": "sylvie", "staleness": 5}).fit(
            _Explodes(), datamodule=FullGraphDataModule(directed_graph(), cache_dir=tmp_path)
        )
    assert time.monotonic() - start < 60


def test_smoothing_and_epoch_adaptive_rule_run(tmp_path) -> None:
    trainer = cpu_trainer(2, max_epochs=6, strategy_kwargs={
        "mode": "sylvie", "staleness": 3, "smoothing": 0.9, "epoch_adaptive": True, "adaptive_tolerance": 0.5})
    trainer.fit(NodeClassifier(conv="sage"), datamodule=FullGraphDataModule(directed_graph(), cache_dir=tmp_path))
    metrics = trainer.callback_metrics
    # a 50 % relative-improvement bar counts most epochs as stalled: bits climb above 1
    assert float(metrics["comm/bits"]) > 1.0
    assert "comm/global_loss" in metrics


class _WithValidation(NodeClassifier):
    def validation_step(self, batch, batch_idx):
        out = self(batch.x, batch.edge_index)
        self.log("val_out", out.abs().mean(), batch_size=1, sync_dist=True)


def test_evaluation_never_disturbs_the_pipeline(tmp_path) -> None:
    """Validation between epochs (fresh fp32 exchanges) leaves training bit-for-bit unchanged."""
    data = directed_graph(seed=23)
    results = []
    for val_batches in (0, 1):
        torch.manual_seed(0)
        model = _WithValidation(conv="sage", num_layers=3)
        trainer = cpu_trainer(3, max_epochs=6, limit_val_batches=val_batches,
                              strategy_kwargs={"mode": "sylvie", "staleness": 3})
        trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path))
        results.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key
