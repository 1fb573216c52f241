"""When the central/marginal overlap runs (:mod:`lightning_fullgraph.nn.overlap`), on forked gloo ranks.

What is observed is behaviour, not what the strategy says about itself: every rank counts its
calls of ``HaloExchanger.exchange_async``, which only the split path of the adapters makes
(the synchronous path calls ``exchange``/``halo``).  The counting wrapper is installed in the
test process before the ranks are forked, so every rank runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch_geometric.data import Data

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.nn import overlap as overlap_module
from lightning_fullgraph.nn.overlap import central_inputs
from tests.conftest import free_port
from tests.helpers import NodeClassifier, cpu_trainer

pytestmark = pytest.mark.timeout(120)

_ASYNC_CALLS = [0]


class _Record(pl.Callback):
    """Each rank writes its decision, its own central share and its split calls at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        part = trainer.datamodule.local_partition
        central, total = central_inputs(part.data.edge_index, part.plan.num_owned, part.plan.marginal_mask)
        d = strategy.overlap_decision
        record = {
            "used": d.used, "share_min": d.share_min, "share_mean": d.share_mean, "reason": d.reason,
            "overlap": strategy.overlap, "local_share": central / total, "async_calls": _ASYNC_CALLS[0],
        }
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(tmp_path: Path, data: Data, world_size: int, monkeypatch, **strategy_kwargs) -> list[dict]:
    """Fits 2 epochs on ``world_size`` ranks; every rank's record, in rank order."""
    original = HaloExchanger.exchange_async

    def counting(self, *args, **kwargs):
        _ASYNC_CALLS[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HaloExchanger, "exchange_async", counting)
    out = tmp_path / "records"
    out.mkdir(parents=True)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # a test may fit several times
    torch.manual_seed(0)
    model = NodeClassifier(conv="gcn", in_dim=data.num_features, num_layers=2)
    trainer = cpu_trainer(world_size, max_epochs=2, callbacks=[_Record(out)], strategy_kwargs=strategy_kwargs)
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=tmp_path / "parts"))
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert len(records) == world_size
    return records


def _graph(edge_index: Tensor, nodes: int, features: int = 8) -> Data:
    g = torch.Generator().manual_seed(0)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    mask = torch.rand(nodes, generator=g) < 0.5
    return Data(x=torch.randn(nodes, features, generator=g), y=torch.randint(0, 3, (nodes,), generator=g),
                edge_index=edge_index, train_mask=mask, val_mask=~mask, test_mask=~mask, num_nodes=nodes)


def _halves(bridges_into_a: int, bridges_into_b: int, half: int = 150) -> Data:
    """Two dense halves (8 random in-edges per node inside each) and directed bridges: the
    first ``bridges_into_a`` nodes of half A get one in-edge from B, the first
    ``bridges_into_b`` nodes of half B one from A.  METIS cuts the bridges, so the rank owning A
    has ``bridges_into_a`` marginal rows, the one owning B ``bridges_into_b``."""
    g = torch.Generator().manual_seed(1)
    edges = []
    for offset in (0, half):
        src = torch.randint(0, half, (half * 8,), generator=g) + offset
        dst = torch.randint(0, half, (half * 8,), generator=g) + offset
        edges.append(torch.stack([src, dst]))
    into_a = torch.arange(bridges_into_a)
    into_b = torch.arange(bridges_into_b) + half
    edges.append(torch.stack([torch.randint(half, 2 * half, (bridges_into_a,), generator=g), into_a]))
    edges.append(torch.stack([torch.randint(0, half, (bridges_into_b,), generator=g), into_b]))
    return _graph(torch.cat(edges, dim=1), 2 * half)


def _random(nodes: int = 120, degree: int = 8) -> Data:
    """A random graph without locality: almost every row has a remote in-neighbour."""
    g = torch.Generator().manual_seed(2)
    return _graph(torch.randint(0, nodes, (2, nodes * degree), generator=g), nodes)


def test_tiny_central_share_gets_no_split_by_default(tmp_path, monkeypatch) -> None:
    """adaqp's default on a graph without locality (central share far below
    ``MIN_CENTRAL_SHARE``): no rank runs the split; ``overlap=True`` forces it on the same graph.

    Negative control (run): with ``MIN_CENTRAL_SHARE = 0.0`` the default path calls
    ``exchange_async`` on every rank (first half fails); with the setting ignored
    (``decide_overlap(None, ...)`` always) the forced half fails."""
    records = _fit(tmp_path / "default", _random(), 2, monkeypatch, mode="adaqp")
    assert all(r["local_share"] < 0.1 for r in records), records  # the graph's property
    assert all(not r["used"] and r["overlap"] is False and r["async_calls"] == 0 for r in records), records
    assert "below" in records[0]["reason"]
    records = _fit(tmp_path / "forced", _random(), 2, monkeypatch, mode="adaqp", overlap=True)
    assert all(r["used"] and r["async_calls"] > 0 for r in records), records


def test_large_central_share_gets_the_split_by_default(tmp_path, monkeypatch) -> None:
    """adaqp's default on two communities joined by a few bridges (central share ~0.95 on
    every rank): every rank runs the split; exact's default (a mode whose row does not overlap)
    and ``overlap=False`` do not.

    Negative control (run): with ``MIN_CENTRAL_SHARE = 1.01`` no rank calls ``exchange_async``
    under the default (first assertion on ``async_calls`` fails)."""
    data = _halves(3, 3)
    records = _fit(tmp_path / "adaqp", data, 2, monkeypatch, mode="adaqp")
    assert all(r["local_share"] > 0.9 for r in records), records  # the graph's property
    assert all(r["used"] and r["async_calls"] > 0 for r in records), records
    for settings in ({"mode": "exact"}, {"mode": "adaqp", "overlap": False}):
        tag = "-".join(map(str, settings.values()))
        records = _fit(tmp_path / tag, data, 2, monkeypatch, **settings)
        assert all(not r["used"] and r["async_calls"] == 0 for r in records), (settings, records)


def test_every_rank_takes_the_same_decision(tmp_path, monkeypatch) -> None:
    """Two halves where every row of B has a remote in-neighbour and few of A do: the rank
    owning A has a central share near 1, the one owning B a share of 0.  Both take the decision
    of the smallest share (off), report the same figures and run the same layers.

    Negative control (run): deciding from the rank's own share (``low = mean = share of this
    rank`` in ``decide_overlap``) turns the split on for A's rank only: the decisions differ and
    A's rank calls ``exchange_async``; this test fails on the first assertion."""
    records = _fit(tmp_path, _halves(5, 150), 2, monkeypatch, mode="adaqp")
    local = sorted(r["local_share"] for r in records)
    assert local[0] < 0.1 and local[-1] > 0.6, local  # the graph's property: the shares straddle any threshold
    assert local[0] < overlap_module.MIN_CENTRAL_SHARE <= local[-1], local  # ... and this one
    decisions = {(r["used"], r["share_min"], r["share_mean"], r["reason"]) for r in records}
    assert len(decisions) == 1, records
    assert records[0]["share_min"] == pytest.approx(local[0])
    assert records[0]["share_mean"] == pytest.approx(sum(local) / len(local))
    assert all(not r["used"] and r["async_calls"] == 0 for r in records), records
