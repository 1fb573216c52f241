"""AdaQP mode against exact mode on Cora and CiteSeer, 4 partitions, GCN and GraphSAGE.

3 seeds each: mean test accuracy within 0.5 points, bytes on the wire per epoch (after the
first bit-width assignment) at most 1/4 of exact mode's.  Offline datasets from
../shared/datasets (skipped with the reason where absent).
"""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import pytest

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
from lightning_fullgraph.datasets import load_dataset
from lightning_fullgraph.models import GNNNodeClassifier

EPOCHS = 100
SEEDS = (0, 1, 2)


def _run(data, conv: str, seed: int, cache, **strategy) -> tuple[float, float, float]:
    pl.seed_everything(seed)
    model = GNNNodeClassifier(conv=conv, in_channels=data.num_features, num_classes=int(data.y.max()) + 1,
                              hidden_channels=64, dropout=0.5)
    dm = FullGraphDataModule(data, num_parts=4, cache_dir=cache)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4,
        strategy=FullGraphStrategy(start_method="fork", timeout=timedelta(seconds=60), seed=seed, **strategy),
        max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm)
    metrics = dict(trainer.callback_metrics)
    (result,) = trainer.test(model, datamodule=dm, verbose=False)
    return result["test_acc"], float(metrics["comm/bytes_sent"]), float(metrics["comm/bits"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("conv", ["gcn", "sage"])
@pytest.mark.parametrize("name", ["Cora", "CiteSeer"])
def test_adaqp_matches_exact_accuracy_with_a_quarter_of_the_bytes(name, conv, shared_datasets, tmp_path) -> None:
    data = load_dataset(name, root=shared_datasets / "Planetoid", cache_dir=tmp_path / "data")
    exact = [_run(data, conv, s, tmp_path / "parts", mode="exact") for s in SEEDS]
    adaqp = [_run(data, conv, s, tmp_path / "parts", mode="adaqp", assign_every=20) for s in SEEDS]
    acc_exact = sum(a for a, _, _ in exact) / len(SEEDS)
    acc_adaqp = sum(a for a, _, _ in adaqp) / len(SEEDS)
    bytes_exact = sum(b for _, b, _ in exact) / len(SEEDS)
    bytes_adaqp = sum(b for _, b, _ in adaqp) / len(SEEDS)
    bits = sum(b for _, _, b in adaqp) / len(SEEDS)
    print(f"{name} {conv}: exact acc {acc_exact:.4f} bytes {bytes_exact:.0f} | adaqp acc {acc_adaqp:.4f} "
          f"bytes {bytes_adaqp:.0f} ({bytes_adaqp / bytes_exact:.3f}x) avg bits {bits:.2f}")
    assert bits < 32
    assert abs(acc_adaqp - acc_exact) <= 0.005
    assert bytes_adaqp <= bytes_exact / 4
