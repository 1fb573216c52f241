"""Compressed modes converge where the halo carries most of the aggregation.

The graph: 12,000 nodes in 16 planted communities, 55 % of the edges between communities,
weak features (an MLP is near chance), 4 METIS parts.  Halo rows are 55 % of the aggregation
inputs (edges from halo rows over all edges plus one self term per node), computed here from
the partitions themselves.  GCN 3 x 256, dropout 0.5, Adam 0.01, 60 epochs, validation every
epoch.

Measured with the fused codec (seeds 0/1/2, this machine; best / mean of the last 5 epochs):
exact 0.9145/0.9127, 0.9165/0.9136, 0.9130/0.9067 (mean best 0.9147); sylvie with its defaults
(synchronous: the share is above ``max_halo_share``; ``epoch_adaptive="auto"`` raises the bits
from 1 as the loss flattens) 0.919/0.9147, 0.915/0.9116, 0.913/0.9069 (0.9157; one bit
throughout, ``epoch_adaptive=False``: 0.9125/0.9098, 0.9100/0.9047, 0.9130/0.9041, 0.9118); adaqp 0.9155/0.9120, 0.9135/0.9120, 0.9185/0.9140 (0.9158); the
stale pipeline forced on (``max_halo_share=1.0``, no guard) 0.534/0.296, 0.647/0.267,
0.594/0.382 (0.592).  With the guard alone (earlier codec, seed 0) 0.867 / 0.687.
With projected messages (the output layer sends ``X W``, 16 values per row, not 256; the
AMD EPYC host, 2026-12-07): exact 0.9185/0.9165, 0.9185/0.9128, 0.9160/0.9137 (0.9177);
sylvie 0.9150/0.9137, 0.9165/0.9115, 0.9120/0.9103 (0.9145); adaqp 0.9175/0.9142,
0.9185/0.9159, 0.9170/0.9106 (0.9177); the stale pipeline 0.4685/0.2884, 0.4285/0.2417,
0.5400/0.2702 (0.4790).

Seeds: ``LFG_CONVERGENCE_SEEDS`` (default ``0``; ``0,1,2`` for the 3-seed means of the
README, about 6 minutes on 2 cores).
"""

from __future__ import annotations

import csv
import os
import tempfile
from datetime import timedelta
from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
from lightning_fullgraph.data.datasets import community_graph
from lightning_fullgraph.models import GNNNodeClassifier
from lightning_fullgraph.partition.cache import load_part

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

RANKS = 4
EPOCHS = 60
SEEDS = tuple(int(s) for s in os.environ.get("LFG_CONVERGENCE_SEEDS", "0").split(","))
PARTS = tempfile.gettempdir() + "/lfg-convergence-parts"
MODES = {
    "exact": dict(mode="exact"),
    "sylvie": dict(mode="sylvie"),
    "adaqp": dict(mode="adaqp", link_costs="uniform"),
    # the stale pipeline as the papers run it: the failure the defaults avoid
    "sylvie-pipelined": dict(mode="sylvie", max_halo_share=1.0, guard=False),
}


@cache
def _graph():
    return community_graph(num_nodes=12000, num_classes=16, homophily=0.45, avg_degree=24, feature_noise=1.0,
                           train_per_class=100, num_val=2000, num_test=2000, seed=0)


def halo_share(data, parts: int) -> float:
    """Edges from halo rows over all edges plus one self term per node, over all parts."""
    dm = FullGraphDataModule(data, num_parts=parts, cache_dir=PARTS)
    dm.prepare_data()
    assert dm.partition_result is not None
    halo = total = 0
    for r in range(parts):
        part = load_part(dm.partition_result.folder, r)
        src = part.data.edge_index[0]
        halo += int((src >= part.plan.num_owned).sum())
        total += src.numel() + part.plan.num_owned
    return halo / total


@cache
def _val_curve(mode: str, seed: int) -> tuple[float, ...]:
    data = _graph()
    pl.seed_everything(seed)
    model = GNNNodeClassifier(conv="gcn", in_channels=data.num_features, num_classes=16, hidden_channels=256,
                              num_layers=3, dropout=0.5, lr=0.01)
    logs = tempfile.mkdtemp()
    trainer = pl.Trainer(
        accelerator="cpu", devices=RANKS,
        strategy=FullGraphStrategy(start_method="fork", timeout=timedelta(seconds=60), seed=seed, **MODES[mode]),
        max_epochs=EPOCHS, logger=CSVLogger(logs, name="run"), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=FullGraphDataModule(data, num_parts=RANKS, cache_dir=PARTS))
    rows = [r for f in sorted(Path(logs).rglob("metrics.csv")) for r in csv.DictReader(open(f, newline=""))]
    curve = tuple(float(r["val_acc"]) for r in rows if r.get("val_acc"))
    assert len(curve) == EPOCHS, len(curve)
    return curve


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _best(mode: str) -> float:
    return _mean(max(_val_curve(mode, s)) for s in SEEDS)


def test_the_graph_is_one_where_the_halo_matters() -> None:
    """The claims below count only where halo rows are at least half of the aggregation inputs.

    Negative control: 2 parts give 0.29 and fail."""
    assert halo_share(_graph(), RANKS) >= 0.5


@pytest.mark.parametrize("mode", ["sylvie", "adaqp"])
def test_compressed_modes_reach_exact_accuracy_without_late_collapse(mode: str) -> None:
    """Best validation accuracy within 1.0 point of exact's (mean over the seeds; the README's
    3-seed figures are within 0.5), and the last 5 epochs' mean within 2 points of the best.

    Negative controls: sylvie with ``max_halo_share=1.0, guard=False`` (the stale pipeline)
    gives 0.59 against 0.91 and fails; with the guard alone, 0.87."""
    assert _best(mode) >= _best("exact") - 0.010
    for seed in SEEDS:
        curve = _val_curve(mode, seed)
        assert _mean(curve[-5:]) >= max(curve) - 0.020, (seed, curve[-5:])


def test_the_stale_pipeline_fails_on_this_graph() -> None:
    """The failure the defaults avoid is real: the stale pipeline, forced on, ends at least 10
    points below exact (measured: 0.59 against 0.91, 3 seeds), so the test above can fail.

    Negative control: forcing the defaults here (``max_halo_share`` at 0.2) passes 0.914 and
    fails this assertion."""
    assert _best("sylvie-pipelined") <= _best("exact") - 0.10
