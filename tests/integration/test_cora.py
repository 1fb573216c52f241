"""Cora, 4 partitions, GCN: the distributed run's accuracy matches the single-process one.

Reads the offline copy in ../shared/datasets (skipped with the reason where absent).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.data.datasets import load_dataset
from lightning_fullgraph.models import GNNNodeClassifier
from tests.helpers import cpu_trainer

pytestmark = pytest.mark.slow

EPOCHS = 100


def _model(data) -> GNNNodeClassifier:
    return GNNNodeClassifier(conv="gcn", in_channels=data.num_features, num_classes=int(data.y.max()) + 1,
                             hidden_channels=16, dropout=0.5, lr=0.01, weight_decay=5e-4)


def _single_process_accuracy(data) -> float:
    """Plain PyG training on the whole graph, no Lightning, no partitions."""
    pl.seed_everything(0)
    model = _model(data)
    opt = model.configure_optimizers()
    for _ in range(EPOCHS):
        model.train()
        opt.zero_grad()
        out = model(data.x, data.edge_index)
        torch.nn.functional.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    return float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())


@pytest.mark.timeout(300)
def test_cora_four_partitions_matches_single_process(shared_datasets, tmp_path) -> None:
    data = load_dataset("Cora", root=shared_datasets / "Planetoid", cache_dir=tmp_path / "data")
    reference = _single_process_accuracy(data)

    pl.seed_everything(0)
    model = _model(data)
    dm = FullGraphDataModule(data, num_parts=4, cache_dir=tmp_path / "parts")
    trainer = cpu_trainer(4, max_epochs=EPOCHS)
    trainer.fit(model, datamodule=dm)
    (result,) = trainer.test(model, datamodule=dm)
    distributed = result["test_acc"]
    print(f"Cora GCN test accuracy: single process {reference:.4f}, 4 partitions {distributed:.4f}")
    assert reference > 0.75, "the reference run itself must learn Cora"
    assert abs(distributed - reference) <= 0.01
