"""Compressed modes against exact mode on Cora and CiteSeer: 4 partitions, GCN and GraphSAGE,
hidden 64, 60 epochs, one seed (``LFG_ACCURACY_SEEDS``, default ``0``; ``0,1,2`` for 3-seed
means), one run per mode and seed, shared by the assertions below.

The model has two layers (``F -> 64 -> C``): the first reads the batch's features (sent
once, cached), so the one per-epoch message is the output layer's, and with projected
messages (the default) that is its projection ``X W``, ``C`` values per halo row each way
(Cora 7, CiteSeer 6), not the 64-wide input.  A compressed row's record is a 4-byte header
(two fp16) plus ``ceil(C b / 8)`` bytes of ``b``-bit levels, against ``4 C`` bytes in fp32:
at ``C = 7``, 11 bytes at 8 bits and 5 at 1 bit against 28.

- adaqp: mean test accuracy within 0.5 points of exact; bytes on the wire per epoch (the last
  epoch, after the bit-width assignments) below what 8-bit records would cost, i.e. the
  assignment gave some rows fewer bits.
- sylvie: mean test accuracy at most 1.5 points below exact (and at most 2.0 above: a
  compressed mode far ahead of exact would point at a broken exact path); bytes per epoch,
  averaged over the run (synchronous epochs send both directions, an epoch before a
  synchronous one sends nothing), at most what 1-bit records cost; every sending epoch at
  1 bit.  (One-sided: with edge-balanced partitions CiteSeer GCN gave exact 0.6733, sylvie
  0.6840 over 3 seeds, a gain inside the seed noise.  1.5 points since the runs went to one
  seed: seed 0 on 2026-12-08 gave sylvie 0.5, 0.6, 1.0 and 0.2 points below exact (Cora GCN,
  Cora SAGE, CiteSeer GCN, CiteSeer SAGE) and adaqp 0.0 to 0.1 above; 3-seed means were held
  to 1.0.)
  (Before projected messages these runs sent the 64-wide input, and the bounds were 1/4 and
  1/20 of exact's bytes.)

Halo share of the aggregation inputs at 4 parts: Cora 5.1 %, CiteSeer 2.6 % (edges from halo
rows over all edges plus one self term per node). Below 20 % these runs are no evidence that a
compressed mode converges (the halo barely enters the aggregation); they check the compressed
paths end to end and their traffic, which one seed does as well as three (12 runs, 105 s alone
on the AMD EPYC host, against 36). (Hidden 64 rather than 256 since 2026-12-05: the same
36 runs took 307 s of a CI run at 256 and 198 s at 64, with the same margins; 40 epochs
left Cora's GraphSAGE under-trained, 0.769, so the epochs stay.) The convergence evidence, on a graph whose halo share is
55 %, is ``tests/integration/test_convergence.py``.

Offline datasets from ../shared/datasets (skipped with the reason where absent).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from functools import cache
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_fullgraph import FullGraphDataModule, FullGraphStrategy
from lightning_fullgraph.data.datasets import load_dataset
from lightning_fullgraph.models import GNNNodeClassifier
from tests.conftest import SHARED_DATASETS

pytestmark = pytest.mark.slow

EPOCHS = 60
HIDDEN = 64
SEEDS = tuple(int(s) for s in os.environ.get("LFG_ACCURACY_SEEDS", "0").split(","))
MODES = {
    "exact": dict(mode="exact"),
    # nominal links: the assignment (and so the bytes) must not depend on timing noise here
    "adaqp": dict(mode="adaqp", assign_every=15, link_costs="uniform"),
    "sylvie": dict(mode="sylvie", staleness=5),
}


def pd_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@cache
def _data(name: str):
    import tempfile

    return load_dataset(name, root=SHARED_DATASETS / "Planetoid", cache_dir=tempfile.mkdtemp())


def _run(name: str, conv: str, seed: int, mode: str) -> tuple[float, float, float]:
    import tempfile

    data = _data(name)
    pl.seed_everything(seed)
    model = GNNNodeClassifier(conv=conv, in_channels=data.num_features, num_classes=int(data.y.max()) + 1,
                              hidden_channels=HIDDEN, dropout=0.5, lr=0.01)
    dm = FullGraphDataModule(data, num_parts=4, cache_dir=tempfile.gettempdir() + "/lfg-accuracy-parts")
    logs = tempfile.mkdtemp()
    trainer = pl.Trainer(
        accelerator="cpu", devices=4,
        strategy=FullGraphStrategy(start_method="fork", timeout=timedelta(seconds=60), seed=seed, **MODES[mode]),
        max_epochs=EPOCHS, logger=CSVLogger(logs, name="run"), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm)
    (result,) = trainer.test(model, datamodule=dm, verbose=False)
    # every epoch's figures as a user's logger recorded them
    # (fit and test each write a version folder; the comm/* figures are the fit's)
    rows = [r for csv in sorted(Path(logs).rglob("metrics.csv")) for r in pd_rows(csv)
            if r.get("comm/bytes_sent") not in (None, "")]
    assert len(rows) == EPOCHS, len(rows)
    sent = [float(r["comm/bytes_sent"]) for r in rows]
    bits = [float(r["comm/bits"]) for r in rows if float(r["comm/bytes_sent"]) > 0]
    if mode == "adaqp":
        # after the bit-width assignments: the last epoch
        return result["test_acc"], sent[-1], bits[-1]
    # mean bytes per epoch over the whole run (sylvie's schedule varies them by epoch)
    return result["test_acc"], sum(sent) / len(sent), max(bits)


@cache
def _summary(name: str, conv: str, mode: str) -> tuple[float, float, float]:
    runs = [_run(name, conv, s, mode) for s in SEEDS]
    return tuple(sum(r[i] for r in runs) / len(runs) for i in range(3))  # type: ignore[return-value]


CASES = [(n, c) for n in ("Cora", "CiteSeer") for c in ("gcn", "sage")]


def record_share(name: str, bits: int) -> float:
    """Bytes of a ``bits``-bit record of one output-layer row over its fp32 bytes (the module
    docstring's wire format)."""
    width = int(_data(name).y.max()) + 1
    return (4 + math.ceil(width * bits / 8)) / (4 * width)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "conv"), CASES)
def test_adaqp_accuracy_and_traffic(name, conv, shared_datasets) -> None:
    acc_e, bytes_e, _ = _summary(name, conv, "exact")
    acc_a, bytes_a, bits_a = _summary(name, conv, "adaqp")
    print(f"\n{name} {conv}: exact {acc_e:.4f} ({bytes_e:.0f} B/epoch) | adaqp {acc_a:.4f} "
          f"({bytes_a:.0f} B/epoch, {bytes_e / bytes_a:.1f}x less, {bits_a:.2f} bits)")
    assert abs(acc_a - acc_e) <= 0.005
    assert bytes_a < bytes_e * record_share(name, 8)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "conv"), CASES)
def test_sylvie_accuracy_and_traffic(name, conv, shared_datasets) -> None:
    acc_e, bytes_e, _ = _summary(name, conv, "exact")
    acc_s, bytes_s, bits_s = _summary(name, conv, "sylvie")
    print(f"\n{name} {conv}: exact {acc_e:.4f} ({bytes_e:.0f} B/epoch) | sylvie {acc_s:.4f} "
          f"({bytes_s:.0f} B/epoch, {bytes_e / bytes_s:.1f}x less, {bits_s:.2f} bits)")
    assert bits_s == 1.0
    assert acc_e - 0.015 <= acc_s <= acc_e + 0.020
    assert bytes_s <= bytes_e * record_share(name, 1)
